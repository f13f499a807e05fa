"""The prefill side of the handoff: computes a prompt's KV and samples the first token, then parks the sequence in
TRANSFERRING (out of the batch, its pages still owned, `seq.handoff` set) until the worker reports that decode
acknowledged (pages scrubbed and freed; decode owns the request from then on) or refused (the request FAILS here
too, pages freed). `seq.reservation` is decode's, where its KV goes; `seq.handoff` says whether and when the worker
sent it (its transfer), and stays on the Sequence after the request ended, for the worker's answer.
"""

from __future__ import annotations

import time

from kvseal.engine.connector import Host, KVConnector
from kvseal.engine.sequence import Handoff, Route, Sequence
from kvseal.errors import KvsealError
from kvseal.kv.allocator import pages_for
from kvseal.lifecycle import State
from kvseal.transfer.manifest import KVManifest, PagePayload, PoolPages, build_manifest
from kvseal.wire.messages import GenerateRequest, TokenLogprob
from kvseal.wire.reservation import Reservation
from kvseal.wire.roles import Role


class PrefillConnector(KVConnector):
    role = Role.PREFILL

    def __init__(self, engine: Host) -> None:
        assert engine.role == Role.PREFILL, engine.role
        super().__init__(engine)

    def prefill(self, req: GenerateRequest, route: Route, reservation: Reservation) -> None:
        """req joins the batch; its KV goes to decode's `reservation`. Refused, its final delta says why."""
        seq = self.engine.add_request(req, route)
        seq.reservation = reservation
        if self.engine.forensics is not None and not seq.life.terminal:
            self.engine.forensics.log_of(seq).reservation_id = reservation.reservation_id

    def after_prefill(self, seq: Sequence, tok: int, lp: TokenLogprob | None) -> bool:
        seq.life.advance(State.TRANSFERRING)
        seq.handoff = Handoff(tok, lp, pages_for(len(seq.prompt_ids), self.engine.pool.page_size))
        return True

    def take_ready(self) -> list[Sequence]:
        """The live sequences handed off since the last call, each once, in arrival order: due now (the worker may
        hold one back)."""
        ready = [s for s in self.handoffs() if s.handoff is not None and s.handoff.due is None]
        now = time.monotonic()
        for s in ready:
            assert s.handoff is not None
            s.handoff.due = now
        return ready

    def handoffs(self) -> list[Sequence]:
        """The live sequences whose KV waits for decode to take it (held back, in flight, or not yet taken)."""
        return [s for s in self.engine.requests if s.handoff is not None]

    def package(self, seq: Sequence, reservation: Reservation,
                staged: bool = True) -> tuple[KVManifest, PagePayload | PoolPages]:
        """The manifest that describes the prompt's pages to decode, and the pages: packed page-major for a
        staging transport, else where they lie (checksums over them in place; they stay owned until the
        handoff ends)."""
        h = seq.handoff
        assert h is not None and not seq.life.terminal, f"{seq.request_id} is not waiting for its handoff"
        pool = self.engine.pool
        pages = PoolPages(pool.k, pool.v, tuple(seq.pages[: h.num_pages]))
        payload: PagePayload | PoolPages = pages.pack() if staged else pages
        lp = h.first_logprob
        manifest = build_manifest(
            reservation, payload, num_tokens=len(seq.prompt_ids), first_token=h.first_token, kv=self.engine.kv_spec,
            first_logprob=None if lp is None else lp.logprob,
            first_top=[] if lp is None else lp.top)
        return manifest, payload

    def end_handoff(self, request_id: str, error: KvsealError | None) -> None:
        """Decode acknowledged (error None: release, decode owns the request now) or it did not (FAILED). A request
        that ended meanwhile: nothing (a late acknowledgement finds nothing)."""
        e = self.engine
        seq = e.requests.live(request_id)
        if seq is None or seq.handoff is None:
            return
        if error is None:
            e.scheduler.release(seq)  # own pages scrubbed before reuse; cached prompt pages stay cached
            e.requests.drop(seq)
            if e.forensics is not None:
                e.forensics.row(seq, "handed_off", None)
        else:
            e.end(seq, lambda: seq.life.fail(error))

    def export_pages(self) -> int:
        """Pages of the NIXL export window for each decode worker: room for two prompts of the whole context window,
        or a quarter of the pool if that is more, never more than the pool. An offer that finds it full waits for
        decode's answers (up to the transfer timeout); memory: this many pages per decode worker, beside the pool."""
        pool = self.engine.pool.num_pages
        return min(pool, max(2 * pages_for(self.engine.context_window, self.engine.pool.page_size), pool // 4))

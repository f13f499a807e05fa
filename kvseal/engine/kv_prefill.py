"""The prefill side of the handoff: computes a prompt's KV and samples the first token, then parks the sequence in
TRANSFERRING (out of the batch, its pages still owned, `seq.handoff` set) until the worker reports that decode
acknowledged (pages scrubbed and freed; decode owns the request from then on) or refused (the request FAILS here
too, pages freed).
"""

from __future__ import annotations

from kvseal.engine.connector import KVConnector
from kvseal.engine.engine import Engine
from kvseal.engine.sequence import Handoff, Sequence
from kvseal.errors import KvsealError
from kvseal.kv.allocator import pages_for
from kvseal.lifecycle import State
from kvseal.transfer.manifest import KVManifest, PagePayload, PoolPages, build_manifest
from kvseal.wire.messages import TokenLogprob
from kvseal.wire.reservation import Reservation
from kvseal.wire.roles import Role


class PrefillConnector(KVConnector):
    role = Role.PREFILL

    def __init__(self, engine: Engine) -> None:
        assert engine.role == Role.PREFILL, engine.role
        self.engine = engine
        engine.kv = self
        self._ready: list[Sequence] = []  # handed off since the last take_ready, in order

    def after_prefill(self, seq: Sequence, tok: int, lp: TokenLogprob | None) -> bool:
        seq.life.advance(State.TRANSFERRING)
        seq.handoff = Handoff(tok, lp, pages_for(len(seq.prompt_ids), self.engine.pool.page_size))
        self._ready.append(seq)
        return True

    def request_finished(self, seq: Sequence) -> bool:
        seq.handoff = None  # ended before decode took it: a late acknowledgement finds nothing
        return False

    def take_ready(self) -> list[Sequence]:
        """The sequences whose KV is ready to send, in order, each once (those that ended meanwhile left out)."""
        ready, self._ready = self._ready, []
        return [s for s in ready if s.handoff is not None]

    def package(self, seq: Sequence, reservation: Reservation,
                staged: bool = True) -> tuple[KVManifest, PagePayload | PoolPages]:
        """The manifest that describes the prompt's pages to decode, and the pages: packed page-major for a
        staging transport, else where they lie (checksums over them in place; they stay owned until the
        handoff ends)."""
        h = seq.handoff
        assert h is not None, f"{seq.request_id} is not waiting for its handoff"
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
        """Decode acknowledged (error None: release, decode owns the request now) or it did not (FAILED)."""
        e = self.engine
        seq = e.seqs.get(request_id)
        if seq is None or seq.handoff is None:
            return
        if error is None:
            seq.handoff = None
            e.scheduler.release(seq)  # own pages scrubbed before reuse; cached prompt pages stay cached
            e.seqs.pop(request_id, None)
            if e.forensics is not None:
                e.forensics.row(seq, "handed_off", None)
        else:
            e.end(seq, lambda: seq.life.fail(error))

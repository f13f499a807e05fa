"""The two halves of the engine for disaggregated serving.

PrefillEngine: computes a prompt's KV and samples the first token, then parks the sequence in TRANSFERRING
with its pages still owned, until the worker reports that decode acknowledged (pages scrubbed and freed)
or refused (the request FAILS here too, pages freed). From the acknowledgement on, decode owns the request.

DecodeEngine: reserves pages for a prompt (RESERVED), and admits the request into its batch only after
the worker verified the arrived KV against that reservation (TRANSFERRING -> VERIFIED -> DECODING).
A reservation that is released (the prefill side refused), or that times out, ends with its error and
its pages scrubbed and freed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvseal.engine.engine import Engine
from kvseal.engine.messages import GenerateRequest, TokenLogprob
from kvseal.engine.sequence import Sequence
from kvseal.errors import KvsealError, Overloaded, TransferTimeout, TransferVerificationFailed
from kvseal.kv.allocator import OutOfPages, pages_for
from kvseal.lifecycle import State
from kvseal.transfer.manifest import (
    KVManifest,
    PagePayload,
    Reservation,
    build_manifest,
    dtype_name,
    new_nonce,
    new_reservation_id,
    pack_pages,
    page_checksums,
    page_nbytes,
    unpack_into,
    verify,
)


@dataclass
class Handoff:
    """A prefilled sequence waiting for its KV to be taken by decode."""

    seq: Sequence
    first_token: int
    first_logprob: TokenLogprob | None
    num_pages: int  # pages holding the prompt's KV: ceil(prompt_len / page_size)


class PrefillEngine(Engine):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, role="prefill", **kwargs)  # type: ignore[misc, arg-type]
        self.handoffs: dict[str, Handoff] = {}
        self._ready: list[Handoff] = []

    def take_ready(self) -> list[Handoff]:
        ready, self._ready = self._ready, []
        return ready

    def _on_sampled(self, seq: Sequence, tok: int, lp: TokenLogprob | None) -> None:
        seq.life.advance(State.TRANSFERRING)
        self.scheduler.running.remove(seq)  # out of the batch; its pages stay owned until the handoff ends
        h = Handoff(seq, tok, lp, pages_for(len(seq.prompt_ids), self.pool.page_size))
        self.handoffs[seq.request_id] = h
        self._ready.append(h)

    def package(self, h: Handoff, reservation: Reservation) -> tuple[KVManifest, PagePayload]:
        """The prompt's pages, packed page-major, and the manifest that describes them to decode."""
        payload = pack_pages(self.pool.k, self.pool.v, h.seq.pages[: h.num_pages])
        lp = h.first_logprob
        manifest = build_manifest(
            reservation, payload, num_tokens=len(h.seq.prompt_ids), first_token=h.first_token,
            model_fingerprint=self.fingerprint, page_size=self.pool.page_size, kv_dtype=dtype_name(self.kv_dtype),
            kv_layout=self.kv_layout, first_logprob=None if lp is None else lp.logprob,
            first_top=[] if lp is None else lp.top)
        return manifest, payload

    def end_handoff(self, request_id: str, error: KvsealError | None) -> None:
        """Decode acknowledged (error None: release, decode owns the request now) or it did not (FAILED)."""
        h = self.handoffs.pop(request_id, None)
        if h is None:
            return
        seq = h.seq
        if error is None:
            self.scheduler.release(seq)  # own pages scrubbed before reuse; cached prompt pages stay cached
            self.seqs.pop(request_id, None)
            if self.forensics is not None:
                self.forensics.row(seq, "handed_off", None)
        else:
            self._end(seq, lambda: seq.life.fail(error))

    def _forget(self, request_id: str) -> None:
        h = self.handoffs.pop(request_id, None)
        if h is not None:
            self._ready = [x for x in self._ready if x is not h]



class DecodeEngine(Engine):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, role="decode", **kwargs)  # type: ignore[misc, arg-type]
        self.reserved: dict[str, tuple[Sequence, float]] = {}  # request id -> (seq, deadline)
        self.reservations: dict[str, Reservation] = {}  # request id -> what was promised to prefill

    def reserve(self, req: GenerateRequest, timeout_s: float, kv_endpoint: str) -> Reservation:
        """Set pages aside for the prompt's KV. Raises the request's error (nothing is held) on refusal."""
        seq = self._reserve_pages(req, timeout_s)
        res = Reservation(
            request_id=req.request_id, reservation_id=new_reservation_id(), nonce=new_nonce(),
            num_tokens=len(req.prompt_ids), page_ids=list(seq.pages), model_fingerprint=self.fingerprint,
            page_size=self.pool.page_size, kv_dtype=dtype_name(self.kv_dtype), kv_layout=self.kv_layout,
            kv_endpoint=kv_endpoint)
        self.reservations[req.request_id] = res
        if self.forensics is not None:
            self.forensics.log_of(seq).reservation_id = res.reservation_id
        return res

    def accept(self, manifest: KVManifest, payload: PagePayload, check: bool = True) -> None:
        """KV arrived: verify it against the reservation (seal 4), write it into the reserved pages and admit
        the request. On any mismatch the request FAILS (pages scrubbed and freed) and the error is raised
        for the sender's nack; an arrival for no live reservation (never made, released, expired, failed,
        already used) is refused and changes nothing. `check=False` exists only for the test-only incident
        fault."""
        rid = manifest.request_id
        res = self.reservations.get(rid)
        entry = self.reserved.get(rid)
        if res is None or entry is None or entry[0].life.state is not State.RESERVED:
            err = TransferVerificationFailed(f"KV arrived for request {rid!r}, which holds no reservation here")
            err.field = "reservation"
            raise err
        seq = entry[0]
        self.reservations.pop(rid, None)  # one arrival per reservation: a second one finds nothing
        seq.life.advance(State.TRANSFERRING)
        try:
            if check:
                verify(manifest, res, payload, expected_fingerprint=self.fingerprint,
                       page_bytes=page_nbytes(self.pool.k), vocab_size=self.arch.vocab_size,
                       logprobs=seq.params.logprobs)
        except TransferVerificationFailed as err:
            self._verification(seq, "failed", manifest, payload, err.field)
            self.release(rid, err, rejected=False)
            raise
        self._verification(seq, "ok" if check else "unverified", manifest, payload)
        unpack_into(self.pool.k, self.pool.v, res.page_ids[: payload.num_pages], payload)
        if self.forensics is not None:
            self.forensics.transferred(seq, res.page_ids[: payload.num_pages], manifest.num_tokens)
        m = manifest
        lp = None if m.first_logprob is None else TokenLogprob(m.first_token, m.first_logprob, list(m.first_top))
        self.admit_verified(rid, m.first_token, lp)

    def _verification(self, seq: Sequence, result: str, m: KVManifest, payload: PagePayload,
                      field: str | None = None) -> None:
        """The ledger's per-page verification record: every page matched (ok), was not checked (the incident
        fault), or, after a failure, which pages' checksums differed (when the counts allowed comparing)."""
        if self.forensics is None:
            return
        if result == "failed":
            same = len(m.page_checksums) == payload.num_pages and payload.num_pages > 0 and payload.nbytes > 0
            pages = (["ok" if a == b else "mismatch" for a, b in zip(m.page_checksums, page_checksums(payload))]
                     if same else [])
        else:
            pages = [result] * payload.num_pages
        self.forensics.log_of(seq).verification = {"result": result, "field": field, "pages": pages}

    def _reserve_pages(self, req: GenerateRequest, timeout_s: float) -> Sequence:
        seq = self._admit(req)
        if seq is None:
            final = self._out.pop()
            assert final.error is not None
            raise KvsealError.from_info(final.error)
        seq.life.advance(State.RESERVED)
        need = self.pages_for_prompt(len(seq.prompt_ids))
        try:
            if self.pages_available() < need:
                raise OutOfPages(f"{need} pages wanted, {self.pages_available()} available")
            seq.pages = self.allocator.allocate(seq.owner, need)
        except OutOfPages:
            seq.life.reject(Overloaded("the decode worker has no free KV pages right now; retry later"))
            self.seqs.pop(req.request_id, None)
            raise seq.life.outcome.error from None  # type: ignore[union-attr, misc]
        self.reserved[req.request_id] = (seq, time.monotonic() + timeout_s)
        return seq

    def pages_for_prompt(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.pool.page_size)

    def pages_available(self) -> int:
        """Free pages a new reservation may take. Requests already here come first: pages that waiting (e.g.
        preempted) sequences need to run again are not handed out, or a stream of new arrivals could starve
        them; and every request here keeps one page of room to grow, so that admitting more does not force
        the ones decoding into preemption (their KV dropped and recomputed here)."""
        owed = sum(max(pages_for(s.num_tokens + 1, self.pool.page_size) - len(s.pages), 0)
                   for s in self.scheduler.waiting)
        growing = len(self.scheduler.running) + len(self.scheduler.waiting) + len(self.reserved)
        return self.allocator.num_free - owed - growing

    def admit_verified(self, request_id: str, first_token: int, first_logprob: TokenLogprob | None) -> None:
        """The arrived KV matched the reservation and sits in seq.pages: join the batch."""
        seq, _ = self.reserved.pop(request_id)
        seq.life.advance(State.VERIFIED)
        seq.num_computed = len(seq.prompt_ids)
        seq.first_scheduled = time.monotonic()
        self.scheduler.waiting.append(seq)
        self._append(seq, first_token, first_logprob)

    def release(self, request_id: str, error: KvsealError, rejected: bool) -> None:
        """End a reservation before its KV was used: REJECTED (prefill refused) or FAILED."""
        self.reservations.pop(request_id, None)
        entry = self.reserved.pop(request_id, None)
        if entry is None:
            self.abort(request_id, error)
            return
        seq = entry[0]
        self._end(seq, lambda: seq.life.reject(error) if rejected else seq.life.fail(error))

    def renew(self, request_id: str, deadline: float) -> None:
        """Push a live reservation's deadline out (its prefill is queued behind others); no-op once it ended."""
        entry = self.reserved.get(request_id)
        if entry is not None:
            self.reserved[request_id] = (entry[0], max(entry[1], deadline))

    def expire_reservations(self, now: float) -> None:
        for rid, (seq, deadline) in list(self.reserved.items()):
            if now > deadline:
                self.release(rid, TransferTimeout(
                    f"request {rid}: the prefill worker's KV did not arrive in time; reservation released"),
                    rejected=False)

    def _forget(self, request_id: str) -> None:
        self.reserved.pop(request_id, None)
        self.reservations.pop(request_id, None)

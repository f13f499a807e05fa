"""The decode side of the handoff: reserves pages for a prompt's KV (RESERVED, `seq.reservation` set), and admits the
request into the batch only after the arrived KV was verified against that reservation (TRANSFERRING -> VERIFIED ->
DECODING). A reservation that is released (the prefill side refused), or that times out, ends with its error and its
pages scrubbed and freed. With a transport that moves bytes straight into the reserved pages (NIXL), `claim` checks
the manifest's identity before a byte moves and pins the pages while bytes may land (`seq.landing`): a request that
ends meanwhile (release, abort, expiry) ends at once, but its pages stay owned by it (quarantined) until the
transport says nothing can land any more (`accept_landed` / `landing_failed`); only then are they scrubbed and freed.
Which reservation to grant, and when: engine/decode_admission.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

from kvseal.engine.connector import KVConnector
from kvseal.engine.decode_admission import pages_available
from kvseal.engine.engine import Engine
from kvseal.engine.sequence import Sequence
from kvseal.errors import KvsealError, Overloaded, TransferTimeout, TransferVerificationFailed
from kvseal.kv.allocator import OutOfPages, pages_for
from kvseal.lifecycle import State
from kvseal.transfer.manifest import (
    KVManifest,
    PagePayload,
    PoolPages,
    page_checksums,
    page_nbytes,
    unpack_into,
)
from kvseal.transfer.verify import verify, verify_identity, verify_landed, verify_names
from kvseal.wire.messages import GenerateRequest, TokenLogprob
from kvseal.wire.reservation import Reservation, new_nonce, new_reservation_id
from kvseal.wire.roles import Role


class DecodeConnector(KVConnector):
    role = Role.DECODE

    def __init__(self, engine: Engine, verify_kv: Callable[[], bool] = lambda: True) -> None:
        assert engine.role == Role.DECODE, engine.role
        self.engine = engine
        engine.kv = self
        # False only under the test-only incident fault (hooks.py): arrived KV is used unverified
        self.verify_kv = verify_kv
        # ended while their KV was landing: out of the engine, their pages still owned until the landing ends
        self.quarantined: dict[str, Sequence] = {}

    # -- what the worker and its figures read --------------------------------------------------------
    @property
    def reserved(self) -> dict[str, Sequence]:
        """Requests holding reserved pages, from the reservation until their KV was verified (or they ended)."""
        return {rid: s for rid, s in self.engine.seqs.items() if s.reservation is not None}

    @property
    def reservations(self) -> dict[str, Reservation]:
        """The reservations no arrival has used yet (one arrival per reservation)."""
        return {rid: s.reservation for rid, s in self.engine.seqs.items()
                if s.reservation is not None and s.life.state is State.RESERVED}

    @property
    def landing(self) -> dict[str, Sequence]:
        """Live requests whose KV an in-place transport may be writing into their pages."""
        return {rid: s for rid, s in self.engine.seqs.items() if s.landing}

    def num_reserved(self) -> int:
        return sum(1 for s in self.engine.seqs.values() if s.reservation is not None)

    # -- the engine's fixed points -------------------------------------------------------------------
    def request_finished(self, seq: Sequence) -> bool:
        seq.reservation = None  # one end per reservation: a late arrival or renewal finds nothing
        if not seq.landing:
            return False
        self.quarantined[seq.request_id] = seq  # bytes may still land: free the pages when the landing ends
        return True

    # -- the handoff, in order -----------------------------------------------------------------------
    def reserve(self, req: GenerateRequest, timeout_s: float, kv_endpoint: str, kv_key: str = "",
                kv_session: str = "") -> Reservation:
        """Set pages aside for the prompt's KV. Raises the request's error (nothing is held) on refusal."""
        e = self.engine
        seq = e.admit(req)
        if seq.life.terminal:
            raise seq.life.outcome.error  # type: ignore[union-attr, misc]
        seq.life.advance(State.RESERVED)
        need = pages_for(len(seq.prompt_ids), e.pool.page_size)
        try:
            if (free := pages_available(e, req)) < need:
                raise OutOfPages(f"{need} pages wanted, {free} available")
            seq.pages = e.allocator.allocate(seq.owner, need)
        except OutOfPages:
            seq.life.reject(Overloaded("the decode worker has no free KV pages right now; retry later"))
            e.seqs.pop(req.request_id, None)
            raise seq.life.outcome.error from None  # type: ignore[union-attr, misc]
        seq.reserved_until = time.monotonic() + timeout_s
        seq.reservation = Reservation(
            request_id=req.request_id, reservation_id=new_reservation_id(), nonce=new_nonce(),
            num_tokens=len(req.prompt_ids), page_ids=list(seq.pages), kv=e.kv_spec,
            kv_endpoint=kv_endpoint, kv_key=kv_key, kv_session=kv_session)
        if e.forensics is not None:
            e.forensics.log_of(seq).reservation_id = seq.reservation.reservation_id
        return seq.reservation

    def renew(self, request_id: str, deadline: float) -> None:
        """Push a live reservation's deadline out (its prefill is queued behind others); no-op once it ended."""
        seq = self.engine.seqs.get(request_id)
        if seq is not None and seq.reservation is not None:
            seq.reserved_until = max(seq.reserved_until, deadline)

    def expire_reservations(self, now: float) -> None:
        for rid, seq in self.reserved.items():
            if now > seq.reserved_until:
                self.release(rid, TransferTimeout(
                    f"request {rid}: the prefill worker's KV did not arrive in time; reservation released"),
                    rejected=False)

    def release(self, request_id: str, error: KvsealError, rejected: bool) -> None:
        """End a reservation before its KV was used: REJECTED (prefill refused) or FAILED."""
        seq = self.engine.seqs.get(request_id)
        if seq is None or seq.reservation is None:
            self.engine.abort(request_id, error)
            return
        self.engine.end(seq, lambda: seq.life.reject(error) if rejected else seq.life.fail(error))

    def accept(self, manifest: KVManifest, payload: PagePayload) -> None:
        """KV arrived: verify it against the reservation (seal 4), write it into the reserved pages and admit
        the request. On any mismatch the request FAILS (pages scrubbed and freed) and the error is raised
        for the sender's nack; an arrival for no live reservation (never made, released, expired, failed,
        already used) is refused and changes nothing."""
        e, check = self.engine, self.verify_kv()
        seq, res = self._take_reservation(manifest, check)
        try:
            if check:
                verify(manifest, res, payload, expected_fingerprint=e.fingerprint,
                       page_bytes=page_nbytes(e.pool.k), vocab_size=e.arch.vocab_size,
                       logprobs=seq.params.logprobs)
        except TransferVerificationFailed as err:
            self._verification(seq, "failed", manifest, payload, err.field)
            self.release(seq.request_id, err, rejected=False)
            raise
        self._verification(seq, "ok" if check else "unverified", manifest, payload)
        unpack_into(e.pool.k, e.pool.v, res.page_ids[: payload.num_pages], payload)
        if e.forensics is not None:
            e.forensics.transferred(seq, res.page_ids[: payload.num_pages], manifest.num_tokens)
        self._admit_arrived(seq, manifest)

    def claim(self, manifest: KVManifest) -> list[int]:
        """An in-place transport is about to move the KV into the reserved pages: every check that reads no
        KV byte first (a manifest that does not name this reservation moves nothing; on a mismatch the request
        FAILS), then the pages are pinned until `accept_landed` or `landing_failed`. Returns them."""
        e, check = self.engine, self.verify_kv()
        seq, res = self._take_reservation(manifest, check)
        try:
            if check:
                verify_identity(manifest, res, expected_fingerprint=e.fingerprint,
                                vocab_size=e.arch.vocab_size, logprobs=seq.params.logprobs)
        except TransferVerificationFailed as err:
            self._verification(seq, "failed", manifest, None, err.field)
            self.release(seq.request_id, err, rejected=False)
            raise
        seq.landing = True
        return res.page_ids[: manifest.num_pages]

    def accept_landed(self, manifest: KVManifest) -> None:
        """The claimed pages hold the arrived bytes and nothing more can land in them: verify the page
        checksums in place (seal 4) and admit; on a mismatch the request FAILS, pages scrubbed and freed."""
        rid, check = manifest.request_id, self.verify_kv()
        seq = self._end_landing(rid)
        if seq is None:
            raise TransferVerificationFailed(f"request {rid!r} ended while its KV was landing; its pages were "
                                             f"scrubbed and freed")
        assert seq.reservation is not None
        pool = self.engine.pool
        landed = PoolPages(pool.k, pool.v, tuple(seq.reservation.page_ids[: manifest.num_pages]))
        try:
            if check:
                verify_landed(manifest, seq.reservation, landed)
        except TransferVerificationFailed as err:
            self._verification(seq, "failed", manifest, landed, err.field)
            self.release(rid, err, rejected=False)
            raise
        self._verification(seq, "ok" if check else "unverified", manifest, landed)
        if self.engine.forensics is not None:
            self.engine.forensics.transferred(seq, list(landed.page_ids), manifest.num_tokens)
        self._admit_arrived(seq, manifest)

    def landing_failed(self, request_id: str, error: KvsealError) -> None:
        """The claimed pages' bytes did not all arrive, and nothing can land any more: FAIL, scrub and free."""
        if self._end_landing(request_id) is not None:
            self.release(request_id, error, rejected=False)

    def _take_reservation(self, manifest: KVManifest, check: bool) -> tuple[Sequence, Reservation]:
        """The live reservation the arrival names, used (TRANSFERRING). An arrival that does not name it (wrong
        reservation id or nonce: not from the prefill worker the router chose) is refused and changes nothing: the
        request keeps waiting for its own KV."""
        rid = manifest.request_id
        seq = self.engine.seqs.get(rid)
        res = None if seq is None else seq.reservation
        if seq is None or res is None or seq.life.state is not State.RESERVED:
            err = TransferVerificationFailed(f"KV arrived for request {rid!r}, which holds no reservation here")
            err.field = "reservation"
            raise err
        if check:
            verify_names(manifest, res)
        seq.life.advance(State.TRANSFERRING)  # one arrival per reservation: a second one finds it used
        return seq, res

    def _end_landing(self, rid: str) -> Sequence | None:
        """The landing of rid's KV is over. None if the request ended meanwhile: its pages are freed now."""
        ended = self.quarantined.pop(rid, None)
        if ended is not None:
            ended.landing = False
            self.engine.scheduler.remove(ended)  # nothing can land any more: scrub and free
            return None
        seq = self.engine.seqs.get(rid)
        if seq is None or not seq.landing:
            return None
        seq.landing = False
        return seq

    def _admit_arrived(self, seq: Sequence, m: KVManifest) -> None:
        """The arrived KV matched the reservation and sits in seq.pages: join the batch (once its grammar, which
        started compiling at the reservation, is ready; meanwhile seq waits, its KV held)."""
        lp = None if m.first_logprob is None else TokenLogprob(m.first_token, m.first_logprob, list(m.first_top))
        seq.reservation = None
        seq.life.advance(State.VERIFIED)
        seq.num_computed = len(seq.prompt_ids)
        self.engine.with_grammar(seq, partial(self.engine.join_batch, seq, m.first_token, lp))

    def _verification(self, seq: Sequence, result: str, m: KVManifest, payload: PagePayload | PoolPages | None,
                      field: str | None = None) -> None:
        """The ledger's per-page verification record: every page matched (ok), was not checked (the incident
        fault), or, after a failure, which pages' checksums differed (when the counts allowed comparing)."""
        if self.engine.forensics is None:
            return
        if payload is None:  # refused before a byte moved (an in-place transport's claim)
            pages: list[str] = []
        elif result == "failed":
            same = len(m.page_checksums) == payload.num_pages and payload.num_pages > 0 and payload.nbytes > 0
            got = payload.checksums() if isinstance(payload, PoolPages) else page_checksums(payload) if same else []
            pages = ["ok" if a == b else "mismatch" for a, b in zip(m.page_checksums, got)] if same else []
        else:
            pages = [result] * payload.num_pages
        self.engine.forensics.log_of(seq).verification = {"result": result, "field": field, "pages": pages}

"""The decode side of the handoff: the reservations (engine/kv_reserve.py), then the arrivals. A request is admitted
into the batch only after the arrived KV was verified against its reservation (TRANSFERRING -> VERIFIED ->
DECODING): on any mismatch it FAILS, its pages scrubbed and freed. With a transport that moves bytes straight into
the reserved pages (NIXL), `claim` checks the manifest's identity before a byte moves and pins the pages while bytes
may land (`seq.landing`): a request that ends meanwhile (release, abort, expiry) ends at once, but its pages stay
owned by it (quarantined: it stays in the book) until the transport says nothing can land any more (`accept_landed`
/ `landing_failed`); only then are they scrubbed and freed.
"""

from __future__ import annotations

from functools import partial

from kvseal.engine.connector import Host
from kvseal.engine.kv_reserve import Reserving
from kvseal.engine.sequence import Sequence
from kvseal.errors import ErrorInfo, KvsealError, TransferVerificationFailed, WorkerFailed
from kvseal.lifecycle import State
from kvseal.transfer.base import Arrival
from kvseal.transfer.manifest import KVManifest, PagePayload, PoolPages, page_nbytes, unpack_into
from kvseal.transfer.verify import NAMES, verify, verify_identity
from kvseal.wire.messages import TokenLogprob
from kvseal.wire.reservation import Reservation
from kvseal.wire.roles import Role


class DecodeConnector(Reserving):
    role = Role.DECODE

    def __init__(self, engine: Host) -> None:
        assert engine.role == Role.DECODE, engine.role
        super().__init__(engine)

    # -- what the worker and its figures read (the engine's one book) -----------------------------
    @property
    def landing(self) -> dict[str, Sequence]:
        """Live requests whose KV an in-place transport may be writing into their pages."""
        return {s.request_id: s for s in self.engine.requests if s.landing}

    @property
    def quarantined(self) -> dict[str, Sequence]:
        """Ended while their KV was landing: out of flight, their pages still owned until the landing ends."""
        return {s.request_id: s for s in self.engine.requests.quarantined()}
    def max_frame_bytes(self) -> int:
        """A frame larger than the whole pool is never a real transfer: the transport drops its sender."""
        return self.engine.pool.num_pages * page_nbytes(self.engine.pool.k) + 2**20
    # -- the engine's fixed points -------------------------------------------------------------------
    def request_finished(self, seq: Sequence) -> bool:
        seq.reservation = None  # one end per reservation: a late arrival or renewal finds nothing
        return seq.landing  # bytes may still land: free the pages when the landing ends
    def take_in(self, a: Arrival, check: bool = True) -> ErrorInfo | None:
        """An arrival's KV into its reservation, verified (seal 4; `check` is False only under the test-only incident
        fault) and its request admitted: None. Bytes that did not all land, or that landed for a request that ended
        meanwhile: the claimed pages are scrubbed and freed, and the nack's error returned. A verification failure
        FAILS the request and raises."""
        rid = a.manifest.request_id
        if a.error is not None:  # the claimed pages' bytes did not all land: the request FAILS
            self.landing_failed(rid, KvsealError.from_info(a.error))
            return a.error
        if a.landed is not None and rid in self.quarantined:  # it ended while its KV was landing: nothing to verify
            self.landing_failed(rid, WorkerFailed(f"request {rid!r} ended while its KV was landing"))
            return WorkerFailed(f"request {rid!r} ended on the decode worker while its KV was landing; its pages "
                                f"were scrubbed and freed").to_info()
        if a.landed is not None:
            self.accept_landed(a.manifest, check)
        else:
            assert a.payload is not None
            self.accept(a.manifest, a.payload, check)
        return None

    def accept(self, manifest: KVManifest, payload: PagePayload, check: bool = True) -> None:
        """KV arrived (a staged copy): verify it against the reservation (seal 4), write it into the reserved pages
        and admit the request. On any mismatch the request FAILS (pages scrubbed and freed) and the error is raised
        for the sender's nack; an arrival for no live reservation (never made, released, expired, failed, already
        used) is refused and changes nothing. `check` is False only under the test-only incident fault (hooks.py):
        the KV is used unverified."""
        seq, res = self._reserved(manifest.request_id)
        self._use(seq, res, manifest, payload, check)

    def claim(self, manifest: KVManifest, check: bool = True) -> list[int]:
        """An in-place transport is about to move the KV into the reserved pages: every check that reads no
        KV byte first (a manifest that does not name this reservation moves nothing; on a mismatch the request
        FAILS), then the pages are pinned until `accept_landed` or `landing_failed`. Returns them."""
        e = self.engine
        seq, res = self._reserved(manifest.request_id)
        try:
            if check:
                verify_identity(manifest, res, expected_fingerprint=e.kv_spec.model_fingerprint,
                                vocab_size=e.arch.vocab_size, logprobs=seq.params.logprobs)
        except TransferVerificationFailed as err:
            self._refused(seq, manifest, None, err)
            raise
        self._used(seq)
        seq.landing = True
        return res.page_ids[: manifest.num_pages]

    def accept_landed(self, manifest: KVManifest, check: bool = True) -> None:
        """The claimed pages hold the arrived bytes and nothing more can land in them: verify them where they lie
        (seal 4: the claim ran the checks that read no byte; now every page checksum) and admit; on a mismatch the
        request FAILS, pages scrubbed and freed."""
        rid = manifest.request_id
        seq = self._end_landing(rid)
        if seq is None:
            raise TransferVerificationFailed(f"request {rid!r} ended while its KV was landing; its pages were "
                                             f"scrubbed and freed")
        res, pool = seq.reservation, self.engine.pool
        assert res is not None
        self._use(seq, res, manifest, PoolPages(pool.k, pool.v, tuple(res.page_ids[: manifest.num_pages])), check)

    def _use(self, seq: Sequence, res: Reservation, manifest: KVManifest, pages: PagePayload | PoolPages,
             check: bool) -> None:
        """The arrived pages against the reservation (seal 4), then in the reserved pages (a staged copy is unpacked
        there; bytes that landed in place are there already) and the request admitted. On a mismatch the request
        FAILS (pages scrubbed and freed) and the error is raised for the sender's nack."""
        e = self.engine
        try:
            if check:
                verify(manifest, res, pages, expected_fingerprint=e.kv_spec.model_fingerprint,
                       page_bytes=page_nbytes(e.pool.k), vocab_size=e.arch.vocab_size,
                       logprobs=seq.params.logprobs)
            if isinstance(pages, PagePayload):  # a staged copy enters the reserved pages only once it matched
                unpack_into(e.pool.k, e.pool.v, res.page_ids[: pages.num_pages], pages)
        except TransferVerificationFailed as err:
            self._refused(seq, manifest, pages, err)
            raise
        self._verified(seq, "ok" if check else "unverified", manifest, pages)
        if e.forensics is not None:
            e.forensics.transferred(seq, res.page_ids[: pages.num_pages], manifest.num_tokens)
        self._admit_arrived(seq, manifest)

    def _refused(self, seq: Sequence, m: KVManifest, pages: PagePayload | PoolPages | None,
                 err: TransferVerificationFailed) -> None:
        """An arrival failed its check. One that does not name the reservation (NAMES: not from the prefill worker
        the router chose) changes nothing while no byte may have landed: the request keeps waiting for its own KV.
        Any other mismatch FAILS the request, its pages scrubbed and freed."""
        if err.field in NAMES and seq.life.state is State.RESERVED:
            return
        self._used(seq)  # it ends in the handoff (the stage its error names)
        self._verified(seq, "failed", m, pages, err.field)
        self.release(seq.request_id, err, rejected=False)

    def landing_failed(self, request_id: str, error: KvsealError) -> None:
        """The claimed pages' bytes did not all arrive, and nothing can land any more: FAIL, scrub and free."""
        if self._end_landing(request_id) is not None:
            self.release(request_id, error, rejected=False)

    def _reserved(self, rid: str) -> tuple[Sequence, Reservation]:
        """The live reservation an arrival is for, not yet used by another arrival (one arrival per reservation)."""
        seq = self.engine.requests.live(rid)
        res = None if seq is None else seq.reservation
        if seq is None or res is None or seq.life.state is not State.RESERVED:
            err = TransferVerificationFailed(f"KV arrived for request {rid!r}, which holds no reservation here")
            err.field = "reservation"
            raise err
        return seq, res

    @staticmethod
    def _used(seq: Sequence) -> None:
        """An arrival that names seq's reservation uses it (TRANSFERRING), whatever its check finds: one arrival per
        reservation, a second one finds none."""
        if seq.life.state is State.RESERVED:
            seq.life.advance(State.TRANSFERRING)

    def _end_landing(self, rid: str) -> Sequence | None:
        """The landing of rid's KV is over. None if the request ended meanwhile: its pages are freed now."""
        seq = self.engine.requests.known(rid)
        if seq is None or not seq.landing:
            return None
        seq.landing = False
        if seq.life.terminal:  # quarantined: nothing can land any more, scrub and free
            self.engine.scheduler.remove(seq)
            self.engine.requests.drop(seq)
            return None
        return seq

    def _verified(self, seq: Sequence, result: str, m: KVManifest, payload: PagePayload | PoolPages | None,
                  field: str | None = None) -> None:
        if self.engine.forensics is not None:
            self.engine.forensics.verified(seq, result, m, payload, field)

    def _admit_arrived(self, seq: Sequence, m: KVManifest) -> None:
        """The arrived KV matched the reservation and sits in seq.pages: join the batch (once its grammar, which
        started compiling at the reservation, is ready; meanwhile seq waits, its KV held)."""
        lp = None if m.first_logprob is None else TokenLogprob(m.first_token, m.first_logprob, list(m.first_top))
        seq.reservation = None
        self._used(seq)  # a staged copy arrives and is checked in one step
        seq.life.advance(State.VERIFIED)
        seq.num_computed = len(seq.prompt_ids)
        self.engine.with_grammar(seq, partial(self.engine.join_batch, seq, m.first_token, lp))

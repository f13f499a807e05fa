"""The two halves of the engine for disaggregated serving.

PrefillEngine: computes a prompt's KV and samples the first token, then parks the sequence in TRANSFERRING
with its pages still owned, until the worker reports that decode acknowledged (pages scrubbed and freed)
or refused (the request FAILS here too, pages freed). From the acknowledgement on, decode owns the request.

DecodeEngine: reserves pages for a prompt (RESERVED), and admits the request into its batch only after
the worker verified the arrived KV against that reservation (TRANSFERRING -> VERIFIED -> DECODING).
A reservation that is released (the prefill side refused), or that times out, ends with its error and
its pages scrubbed and freed. With a transport that moves bytes straight into the reserved pages (NIXL),
`claim` checks the manifest's identity before a byte moves and pins the pages while bytes may land: a request
that ends meanwhile (release, abort, expiry) ends at once, but its pages stay owned by it until the transport
says nothing can land any more (`accept_landed` / `landing_failed`); only then are they scrubbed and freed.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from kvseal.engine.engine import Engine
from kvseal.engine.fairness import held_pages
from kvseal.engine.messages import GenerateRequest, TokenLogprob
from kvseal.engine.sequence import Sequence
from kvseal.errors import KvsealError, Overloaded, TransferTimeout, TransferVerificationFailed
from kvseal.kv.allocator import OutOfPages, pages_for
from kvseal.lifecycle import State
from kvseal.transfer.manifest import (
    KVManifest,
    PagePayload,
    PoolPages,
    Reservation,
    build_manifest,
    new_nonce,
    new_reservation_id,
    page_checksums,
    page_nbytes,
    unpack_into,
    verify,
    verify_identity,
    verify_landed,
    verify_names,
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

    def package(self, h: Handoff, reservation: Reservation,
                staged: bool = True) -> tuple[KVManifest, PagePayload | PoolPages]:
        """The manifest that describes the prompt's pages to decode, and the pages: packed page-major for a
        staging transport, else where they lie (checksums over them in place; they stay owned until the
        handoff ends)."""
        pages = PoolPages(self.pool.k, self.pool.v, tuple(h.seq.pages[: h.num_pages]))
        payload: PagePayload | PoolPages = pages.pack() if staged else pages
        lp = h.first_logprob
        manifest = build_manifest(
            reservation, payload, num_tokens=len(h.seq.prompt_ids), first_token=h.first_token, kv=self.kv_spec,
            first_logprob=None if lp is None else lp.logprob,
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
        # claimed by an in-place transport: bytes may be landing in the pages (pinned until the landing ends)
        self.landing: dict[str, tuple[Sequence, Reservation]] = {}
        self.quarantined: dict[str, Sequence] = {}  # ended while landing: pages still owned, freed at its end

    def reserve(self, req: GenerateRequest, timeout_s: float, kv_endpoint: str, kv_key: str = "",
                kv_session: str = "") -> Reservation:
        """Set pages aside for the prompt's KV. Raises the request's error (nothing is held) on refusal."""
        seq = self._reserve_pages(req, timeout_s)
        res = Reservation(
            request_id=req.request_id, reservation_id=new_reservation_id(), nonce=new_nonce(),
            num_tokens=len(req.prompt_ids), page_ids=list(seq.pages), kv=self.kv_spec,
            kv_endpoint=kv_endpoint, kv_key=kv_key, kv_session=kv_session)
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
        seq, res = self._take_reservation(manifest, check)
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
        self._admit_arrived(manifest)

    def claim(self, manifest: KVManifest, check: bool = True) -> list[int]:
        """An in-place transport is about to move the KV into the reserved pages: every check that reads no
        KV byte first (a manifest that does not name this reservation moves nothing; on a mismatch the request
        FAILS), then the pages are pinned until `accept_landed` or `landing_failed`. Returns them."""
        rid = manifest.request_id
        seq, res = self._take_reservation(manifest, check)
        try:
            if check:
                verify_identity(manifest, res, expected_fingerprint=self.fingerprint,
                                vocab_size=self.arch.vocab_size, logprobs=seq.params.logprobs)
        except TransferVerificationFailed as err:
            self._verification(seq, "failed", manifest, None, err.field)
            self.release(rid, err, rejected=False)
            raise
        self.landing[rid] = (seq, res)
        return res.page_ids[: manifest.num_pages]

    def accept_landed(self, manifest: KVManifest, check: bool = True) -> None:
        """The claimed pages hold the arrived bytes and nothing more can land in them: verify the page
        checksums in place (seal 4) and admit; on a mismatch the request FAILS, pages scrubbed and freed."""
        rid = manifest.request_id
        claimed = self._end_landing(rid)
        if claimed is None:
            raise TransferVerificationFailed(f"request {rid!r} ended while its KV was landing; its pages were "
                                             f"scrubbed and freed")
        seq, res = claimed
        landed = PoolPages(self.pool.k, self.pool.v, tuple(res.page_ids[: manifest.num_pages]))
        try:
            if check:
                verify_landed(manifest, res, landed)
        except TransferVerificationFailed as err:
            self._verification(seq, "failed", manifest, landed, err.field)
            self.release(rid, err, rejected=False)
            raise
        self._verification(seq, "ok" if check else "unverified", manifest, landed)
        if self.forensics is not None:
            self.forensics.transferred(seq, list(landed.page_ids), manifest.num_tokens)
        self._admit_arrived(manifest)

    def landing_failed(self, request_id: str, error: KvsealError) -> None:
        """The claimed pages' bytes did not all arrive, and nothing can land any more: FAIL, scrub and free."""
        if self._end_landing(request_id) is not None:
            self.release(request_id, error, rejected=False)

    def _take_reservation(self, manifest: KVManifest, check: bool) -> tuple[Sequence, Reservation]:
        """The live reservation the arrival names, consumed. An arrival that does not name it (wrong reservation
        id or nonce: not from the prefill worker the router chose) is refused and changes nothing: the request
        keeps waiting for its own KV."""
        rid = manifest.request_id
        res = self.reservations.get(rid)
        entry = self.reserved.get(rid)
        if res is None or entry is None or entry[0].life.state is not State.RESERVED:
            err = TransferVerificationFailed(f"KV arrived for request {rid!r}, which holds no reservation here")
            err.field = "reservation"
            raise err
        if check:
            verify_names(manifest, res)
        self.reservations.pop(rid, None)  # one arrival per reservation: a second one finds nothing
        entry[0].life.advance(State.TRANSFERRING)
        return entry[0], res

    def _end_landing(self, rid: str) -> tuple[Sequence, Reservation] | None:
        """The landing of rid's KV is over. None if the request ended meanwhile: its pages are freed now."""
        claimed = self.landing.pop(rid, None)
        ended = self.quarantined.pop(rid, None)
        if ended is not None:
            self.scheduler.remove(ended)  # nothing can land any more: scrub and free
            return None
        return claimed

    def _end(self, seq: Sequence, terminate: Callable[[], bool]) -> None:
        if seq.request_id not in self.landing:
            super()._end(seq, terminate)
            return
        # bytes may still land in its pages: end the request now, free the pages when the landing ends
        if not terminate():
            return
        self.seqs.pop(seq.request_id, None)
        self.reserved.pop(seq.request_id, None)
        self.quarantined[seq.request_id] = seq
        self._out.append(self._final(seq))

    def _admit_arrived(self, manifest: KVManifest) -> None:
        m = manifest
        lp = None if m.first_logprob is None else TokenLogprob(m.first_token, m.first_logprob, list(m.first_top))
        self.admit_verified(m.request_id, m.first_token, lp)


    def _verification(self, seq: Sequence, result: str, m: KVManifest, payload: PagePayload | PoolPages | None,
                      field: str | None = None) -> None:
        """The ledger's per-page verification record: every page matched (ok), was not checked (the incident
        fault), or, after a failure, which pages' checksums differed (when the counts allowed comparing)."""
        if self.forensics is None:
            return
        if payload is None:  # refused before a byte moved (an in-place transport's claim)
            pages: list[str] = []
        elif result == "failed":
            same = len(m.page_checksums) == payload.num_pages and payload.num_pages > 0 and payload.nbytes > 0
            got = payload.checksums() if isinstance(payload, PoolPages) else page_checksums(payload) if same else []
            pages = ["ok" if a == b else "mismatch" for a, b in zip(m.page_checksums, got)] if same else []
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
            if self.pages_available(req) < need:
                raise OutOfPages(f"{need} pages wanted, {self.pages_available(req)} available")
            seq.pages = self.allocator.allocate(seq.owner, need)
        except OutOfPages:
            seq.life.reject(Overloaded("the decode worker has no free KV pages right now; retry later"))
            self.seqs.pop(req.request_id, None)
            raise seq.life.outcome.error from None  # type: ignore[union-attr, misc]
        self.reserved[req.request_id] = (seq, time.monotonic() + timeout_s)
        return seq

    def pages_for_prompt(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.pool.page_size)

    def pages_available(self, req: GenerateRequest | None = None) -> int:
        """Free pages a new reservation (for req) may take. Requests already here come first: pages that waiting
        (e.g. preempted) sequences need to run again are not handed out, or a stream of new arrivals could starve
        them, except (vtc) those of another tenant that would hold more than its fair share of the pool with them
        (as after make_room preempted it for a tenant under its share); and every request here keeps one page of
        room to grow, so that admitting more does not force the ones decoding into preemption (their KV dropped
        and recomputed here)."""
        owed: defaultdict[str, int] = defaultdict(int)
        for s in self.scheduler.waiting:
            owed[s.tenant] += max(pages_for(s.num_tokens + 1, self.pool.page_size) - len(s.pages), 0)
        if req is not None and self.scheduler.fair.vtc:
            held = held_pages(self.seqs.values())
            weights = {req.tenant: req.weight} | {s.tenant: s.weight for s in self.seqs.values()}
            whole = sum(weights.values())
            for t in [t for t in owed if t != req.tenant]:
                if held[t] + owed[t] > weights[t] / whole * self.allocator.num_pages:
                    del owed[t]
        growing = len(self.scheduler.running) + len(self.scheduler.waiting) + len(self.reserved) + len(self.compiling)
        return self.allocator.num_free - sum(owed.values()) - growing

    def make_room(self, req: GenerateRequest) -> bool:
        """vtc: preempt decoding requests of tenants over their fair share of the pool (recomputed here later, output
        so far kept) until req's reservation fits; only for a tenant within its share (fairness.room_victim). The
        shares are those of pages_available: among req's tenant and the tenants of the requests here, so that a
        victim's pages, once it is preempted, are not owed back to it. True when req fits now."""
        need = self.pages_for_prompt(len(req.prompt_ids))
        held = held_pages(self.seqs.values())
        weights = {req.tenant: req.weight} | {s.tenant: s.weight for s in self.seqs.values()}
        while self.pages_available(req) < need:
            victim = self.scheduler.fair.room_victim(self.scheduler.running, req.tenant, req.priority_class, need,
                                                     held, weights, self.allocator.num_pages)
            if victim is None:
                return False
            held[victim.tenant] -= len(victim.pages)
            self.scheduler.preempt(victim)
            victim.life.advance(State.ADMITTED)
        return True

    def within_fair_reservations(self, req: GenerateRequest) -> bool:
        """vtc, while tenants compete (fairness.competing): a new reservation is granted to a tenant only while the
        pages its requests here hold, with the new prompt's, stay within its fair share of the pool (a tenant holding
        none may always reserve one). Pages reserved ahead of a queued prefill do no work: without this, a flood's
        reservations took every page, and another tenant's chat waited for them to be prefilled and decoded, or
        preempted decoding requests whose recompute (as long as a prefill, on a CPU) slowed everyone. A tenant
        alone is not held back, and one whose requests grew past its share is preempted only for a tenant under
        its own (make_room)."""
        fair = self.scheduler.fair
        weights = fair.competing({req.tenant: req.weight} | {s.tenant: s.weight for s in self.seqs.values()},
                                 time.monotonic())
        if not fair.vtc or len(weights) < 2:
            return True
        mine = sum(len(s.pages) for s in self.seqs.values() if s.tenant == req.tenant)
        share = weights[req.tenant] / sum(weights.values()) * self.allocator.num_pages
        return mine == 0 or mine + self.pages_for_prompt(len(req.prompt_ids)) <= share

    def within_share(self, req: GenerateRequest) -> bool:
        """kv_share for a reservation: this tenant's live requests here at their longest (prompt + max_tokens), with
        req, within its share of the pool; a tenant with none here may always reserve (engine/scheduler.py's rule)."""
        if req.kv_share >= 1.0:
            return True
        mine = [s for s in self.seqs.values() if s.tenant == req.tenant]
        if not mine:
            return True
        longest = sum(pages_for(len(s.prompt_ids) + s.params.max_tokens, self.pool.page_size) for s in mine)
        longest += pages_for(len(req.prompt_ids) + req.params.max_tokens, self.pool.page_size)
        return longest <= int(req.kv_share * self.allocator.num_pages)

    def admit_verified(self, request_id: str, first_token: int, first_logprob: TokenLogprob | None) -> None:
        """The arrived KV matched the reservation and sits in seq.pages: join the batch."""
        seq, _ = self.reserved.pop(request_id)
        seq.life.advance(State.VERIFIED)
        seq.num_computed = len(seq.prompt_ids)
        # its grammar started compiling at the reservation; should it still be compiling, seq waits (KV held)
        self._with_grammar(seq, partial(self._join_batch, seq, first_token, first_logprob))

    def _join_batch(self, seq: Sequence, first_token: int, first_logprob: TokenLogprob | None) -> None:
        seq.first_scheduled = time.monotonic()
        self.scheduler.add(seq)
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

"""A decode worker's reservations: pages set aside for a prompt's KV before it is sent. A reservation that finds no
pages waits, queued: a Sequence in RECEIVED in the engine's one book of requests, holding none (as vLLM keeps a
request waiting for remote KV in its waiting queue, with a status). Which one is granted, and when, is
engine/admission.py's. A granted one is RESERVED (`seq.reservation`, `seq.reserved_until`) until its KV arrives
(engine/kv_decode.py) or it is released (the prefill side refused), expires, or is aborted: it ends then with its
error, its pages scrubbed and freed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

from kvseal.engine.connector import Host, KVConnector
from kvseal.engine.sequence import Route, Sequence
from kvseal.errors import KvsealError, Overloaded, TransferTimeout
from kvseal.kv.allocator import OutOfPages
from kvseal.lifecycle import State
from kvseal.wire.messages import GenerateRequest
from kvseal.wire.reservation import Reservation, new_nonce, new_reservation_id


@dataclass(frozen=True)
class KVDoor:
    """Where a reservation's KV comes in, and how long it may take (the decode worker's KV port)."""

    endpoint: str
    timeout_s: float
    key: str = ""  # with fleet keys: the KV port's public key
    session: str = ""  # the MAC framing's session token (zmq with fleet keys)


class Reserving(KVConnector):
    """The reservations half of the decode connector (engine/kv_decode.py adds the arrivals)."""

    def __init__(self, engine: Host) -> None:
        super().__init__(engine)
        self.admission = engine.scheduler.admission

    @property
    def reserved(self) -> dict[str, Sequence]:
        """Requests holding reserved pages, from the reservation until their KV was verified (or they ended)."""
        return {s.request_id: s for s in self.engine.requests if s.reservation is not None}

    @property
    def reservations(self) -> dict[str, Reservation]:
        """The reservations no arrival has used yet (one arrival per reservation)."""
        return {s.request_id: s.reservation for s in self.engine.requests
                if s.reservation is not None and s.life.state is State.RESERVED}

    @property
    def queue(self) -> list[Sequence]:
        """Reservations waiting for pages, oldest first."""
        return self.engine.requests.queued()

    def num_reserved(self) -> int:
        return sum(1 for s in self.engine.requests if s.reservation is not None)

    # -- granted now, or queued for pages ------------------------------------------------------------
    def ask(self, req: GenerateRequest, route: Route, door: KVDoor) -> Reservation | None:
        """req's reservation: granted now, or queued (None: `grant_queued` answers it later; nothing skips ahead of
        a reservation already waiting). Raises the request's error, nothing held, when refused at once: its id is in
        use, the queue is full (max_waiting), or it can never fit."""
        e, adm = self.engine, self.admission
        e.scheduler.fair.seen(req.tenant, req.weight, time.monotonic())
        waiting = len(e.requests.queued())
        seq = e.receive(req, route)
        if seq.life.terminal:
            raise seq.life.outcome.error  # type: ignore[union-attr, misc]
        if not waiting and adm.fits(seq) and adm.may_reserve(seq):
            return self._reserve(seq, door)
        limit = e.cfg.scheduler.max_waiting
        try:
            if waiting >= limit:
                raise Overloaded(f"the decode worker has {waiting} requests waiting for KV pages "
                                 f"(--max-waiting {limit}); retry later")
            e.validate(len(seq.prompt_ids), seq.params.max_tokens)  # one that can never fit: refused at once
        except KvsealError as err:
            e.end(seq, partial(seq.life.reject, err))  # still queued: it leaves, holding nothing
            raise
        return None

    def grant_queued(self, door: KVDoor) -> list[tuple[Sequence, Reservation | KvsealError]]:
        """The queued reservations granted now (the one fairness picks, once it fits, with room made), then those
        refused: a queue where no page was freed for wait_timeout_s cannot move (a queue that moves never times
        out). Each with its answer, for the worker to send."""
        e, adm = self.engine, self.admission
        answers: list[tuple[Sequence, Reservation | KvsealError]] = []
        while (seq := adm.next_reservation()) is not None and adm.make_room_for(seq, self._preempt):
            try:
                answers.append((seq, self._reserve(seq, door)))
            except KvsealError as err:
                answers.append((seq, err))
        limit = e.cfg.scheduler.wait_timeout_s
        for seq in adm.overdue(time.monotonic()):
            starved = Overloaded(f"no KV pages were freed on the decode worker for {limit:g}s; retry later")
            e.end(seq, partial(seq.life.reject, starved))
            answers.append((seq, starved))
        return answers

    def reserve(self, req: GenerateRequest, timeout_s: float, kv_endpoint: str, kv_key: str = "",
                kv_session: str = "") -> Reservation:
        """Set pages aside for the prompt's KV now, asking no queue. Raises the request's error (nothing is held)
        on refusal."""
        seq = self.engine.receive(req)
        if seq.life.terminal:
            raise seq.life.outcome.error  # type: ignore[union-attr, misc]
        return self._reserve(seq, KVDoor(kv_endpoint, timeout_s, kv_key, kv_session))

    def _reserve(self, seq: Sequence, door: KVDoor) -> Reservation:
        e = self.engine
        if not e.admit(seq):
            raise seq.life.outcome.error  # type: ignore[union-attr, misc]
        seq.life.advance(State.RESERVED)
        need = self.admission.pages_wanted(seq)
        try:
            if (free := self.admission.pages_available(seq)) < need:
                raise OutOfPages(f"{need} pages wanted, {free} available")
            seq.pages = e.allocator.allocate(seq.owner, need)
        except OutOfPages:
            seq.life.reject(Overloaded("the decode worker has no free KV pages right now; retry later"))
            e.requests.drop(seq)
            raise seq.life.outcome.error from None  # type: ignore[union-attr, misc]
        seq.reserved_until = time.monotonic() + door.timeout_s
        seq.reservation = Reservation(
            request_id=seq.request_id, reservation_id=new_reservation_id(), nonce=new_nonce(),
            num_tokens=len(seq.prompt_ids), page_ids=list(seq.pages), kv=e.kv_spec,
            kv_endpoint=door.endpoint, kv_key=door.key, kv_session=door.session)
        if e.forensics is not None:
            e.forensics.log_of(seq).reservation_id = seq.reservation.reservation_id
        return seq.reservation

    def _preempt(self, seq: Sequence) -> None:
        """Room made for a reservation: seq (decoding) is recomputed here later, its output so far kept."""
        self.engine.scheduler.preempt(seq)
        seq.life.advance(State.ADMITTED)

    def renew(self, request_id: str, deadline: float) -> None:
        """Push a live reservation's deadline out (its prefill is queued behind others); no-op once it ended."""
        seq = self.engine.requests.live(request_id)
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
        seq = self.engine.requests.live(request_id)
        if seq is None or seq.reservation is None:
            self.engine.abort(request_id, error)
            return
        self.engine.end(seq, lambda: seq.life.reject(error) if rejected else seq.life.fail(error))

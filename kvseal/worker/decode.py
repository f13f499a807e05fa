"""The decode worker: reserve pages, receive KV, verify it against the reservation, then decode.

A request joins a batch only after every manifest field and every page checksum matched its reservation
(seal 4). A mismatch nacks the sender, FAILS the request with the verification error, scrubs and frees
the reserved pages, and tells the router; not one token is produced from unverified KV.

A reservation that finds no free pages waits (bounded by --max-waiting, then 503). The next one granted is the
one the engine's fairness would admit next (engine/fairness.py: with vtc, of the tenant served least; within a
tenant by priority, then arrival; with off, arrival order), and only when it fits: no other request takes pages
ahead of it. With vtc, a reservation of a tenant within its fair share of the pool that finds no room preempts
decoding requests of the tenant most over its share (recomputed here later, their output so far kept:
engine/admission.py). A tenant with a kv_share holds at most that share of the pool in reservations and requests
(at their longest); its further reservations wait without holding back other tenants'. While tenants compete (vtc),
a reservation is granted to a tenant only while its requests here stay within its fair share of the pool. Each
request's deltas are numbered for the router's continuity check (`Sequence.route`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvseal.auth.keys import MemberKeys
from kvseal.engine.engine import Engine
from kvseal.engine.kv_decode import DecodeConnector
from kvseal.engine.kv_reserve import KVDoor
from kvseal.engine.sequence import Route, Sequence
from kvseal.errors import InternalError, KvsealError, TransferVerificationFailed, WorkerFailed
from kvseal.hooks import Hooks
from kvseal.transfer.base import Arrival, create_transport
from kvseal.transfer.manifest import KVManifest
from kvseal.wire import protocol as P
from kvseal.wire.messages import GenerateDelta
from kvseal.wire.roles import Role
from kvseal.worker.server import WorkerServer

log = logging.getLogger("kvseal.decode")
_T = TypeVar("_T")


class DecodeWorker(WorkerServer):
    role = Role.DECODE

    def __init__(self, engine: Engine, bind: str, kv_bind: str, hooks: Hooks,
                 reservation_timeout_s: float = 120.0, drain_timeout_s: float = 600.0,
                 kv_transport: str = "zmq", keys: MemberKeys | None = None, kv_channel: str = "mac",
                 kv_advertise_host: str | None = None) -> None:
        super().__init__(engine, bind, hooks, drain_timeout_s, keys)
        self.kv = engine.connector(DecodeConnector)
        self.kv_transport = kv_transport
        self.transport = create_transport(
            kv_transport, max_frame_bytes=self.kv.max_frame_bytes(), keys=keys,
            **({"encrypt": True} if kv_channel == "curve" and kv_transport == "zmq" else {}))
        self.kv.register(self.transport)
        endpoint = self.transport.listen(kv_bind)
        if kv_advertise_host:  # bound on a wildcard (0.0.0.0 in a pod): prefill reaches it by this name, same port
            endpoint = f"tcp://{kv_advertise_host}:{endpoint.rsplit(':', 1)[1]}"
        # what every reservation here says: where its KV comes in, how long it may take, the KV port's keys
        self.door = KVDoor(endpoint, reservation_timeout_s, self.keys.public if self.keys is not None else "",
                           getattr(self.transport, "kv_session", ""))
        self._next_expiry = 0.0

    @property
    def kv_endpoint(self) -> str:
        return self.door.endpoint

    def figures(self) -> dict[str, Any]:
        return {**super().figures(), "kv_endpoint": self.kv_endpoint,
                "kv_channel": ("mac" if getattr(self.transport, "kv_session", "") else "curve") if self.keys
                else "plain",
                "kv_landing": len(self.kv.landing), "kv_quarantined": len(self.kv.quarantined),
                **self.kv_figures(), "reservations": self.kv.num_reserved(),
                "reservations_queued": self.queued()}

    def reservation_timeout(self) -> float | None:
        return self.door.timeout_s

    def kv_figures(self) -> dict[str, int]:
        return {"kv_quarantined_pages": sum(len(s.pages) for s in self.kv.quarantined.values()),
                **self.transport.figures()}

    def handle(self, ident: bytes, msg: P.Message) -> None:
        match msg:
            case P.ReserveReq(call_id=cid, request=req):
                self.counters["requests_received"] += 1
                try:
                    self.refuse_new()
                    res = self.kv.ask(req, Route(ident, cid), self.door)  # None: queued, answered when granted
                    if res is not None:
                        self.send(ident, P.ReserveResp(call_id=cid, reservation=res))
                except KvsealError as err:
                    self.send(ident, P.ReserveResp(call_id=cid, error=err.to_info()))
            case P.ReleaseReq(request_id=rid, error=err, rejected=rejected):
                self.kv.release(rid, KvsealError.from_info(err), rejected)
            case P.RenewReq(request_id=rid):
                self.kv.renew(rid, time.monotonic() + self.door.timeout_s)
            case _:
                super().handle(ident, msg)

    @property
    def queue(self) -> list[Sequence]:
        """Reservations waiting for pages, oldest first (queued Sequences in the engine's book)."""
        return self.kv.queue

    # -- the loop --------------------------------------------------------------------------------------
    def pump(self) -> None:
        while (arrival := self.transport.recv(0, self._claim)) is not None:
            self._arrive(arrival)
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + 0.5
            self.kv.expire_reservations(now)
        for seq, answer in self.kv.grant_queued(self.door):
            assert seq.route is not None  # a queued reservation came from a router
            self.send(seq.route.ident, P.ReserveResp(call_id=seq.route.call_id, reservation=answer)
                      if not isinstance(answer, KvsealError) else
                      P.ReserveResp(call_id=seq.route.call_id, error=answer.to_info()))

    def _claim(self, manifest: KVManifest) -> list[int]:
        """For an in-place transport: the reserved pages the KV may land in (pinned), or the refusal."""
        return self._checked(manifest.request_id, "claiming pages for",
                             lambda: self.kv.claim(manifest, self.hooks.verify_kv()))

    def _arrive(self, a: Arrival) -> None:
        """One arrival, answered once: acked once its KV was verified and its request admitted, else nacked with the
        error that ended it. A read past its deadline is not answered yet: its request ends, its pages stay claimed,
        and the arrival that ends the landing follows."""
        rid = a.manifest.request_id
        if a.still_landing:
            assert a.error is not None
            log.warning("KV of %r is late: %s", rid, a.error.message)
            self.engine.fail(rid, KvsealError.from_info(a.error))
            return
        if a.error is not None:
            log.warning("KV of %r did not arrive: %s", rid, a.error.message)
        try:
            nack = self._checked(rid, "accepting", lambda: self.kv.take_in(a, self.hooks.verify_kv()))
            checked = nack is None
            self.counters["transfers_acked" if checked else "transfers_refused"] += 1
        except KvsealError as err:  # refused by the check (counted), or a fault: the request already FAILED
            nack, checked = err.to_info(), True
        if checked:  # bytes that reached the check, whatever it found
            self.counters["kv_bytes_received"] += (a.payload or a.landed).nbytes  # type: ignore[union-attr]
        a.reply(nack is None, nack)

    def _checked(self, rid: str, what: str, step: Callable[[], _T]) -> _T:
        """One step of taking KV in. A verification failure is counted and raised (the request already FAILED);
        anything unexpected fails only the request it named, with an InternalError, never this process."""
        try:
            return step()
        except TransferVerificationFailed as err:
            log.warning("refusing KV: %s", err.message)
            self.counters["transfers_refused"] += 1
            self.verification_failures[err.field] = self.verification_failures.get(err.field, 0) + 1
            raise
        except Exception:  # no arrival ends this process; the request it named fails
            log.exception("%s the KV of %r failed", what, rid)
            failed = InternalError(f"the decode worker failed while {what} the KV of request {rid!r}")
            self.kv.release(rid, failed, rejected=False)
            self.counters["transfers_refused"] += 1
            raise failed from None

    def route(self, out: list[tuple[Sequence, GenerateDelta]]) -> None:
        for seq, d in out:
            if seq.route is not None:  # none: its router is gone
                self.send(seq.route.ident, P.DeltaMsg(delta=d, seq=seq.route.sent))
                seq.route.sent += 1

    def peer_lost(self, ident: bytes) -> None:
        err = WorkerFailed("the router stopped reading this request's output; it ended on the decode worker")
        for seq in self.engine.routed_to(ident):
            seq.route = None  # its final delta has nowhere to go; a queued one leaves unanswered
            self.engine.fail(seq.request_id, err)

    def queued(self) -> int:
        return len(self.kv.queue)

    def sent_deltas(self, request_id: str) -> int:
        seq = self.engine.request(request_id)
        return 0 if seq is None or seq.route is None else seq.route.sent

    def close(self) -> None:
        self.transport.close()
        super().close()

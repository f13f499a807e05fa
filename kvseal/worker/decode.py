"""The decode worker: reserve pages, receive KV, verify it against the reservation, then decode.

A request joins a batch only after every manifest field and every page checksum matched its reservation
(seal 4). A mismatch nacks the sender, FAILS the request with the verification error, scrubs and frees
the reserved pages, and tells the router; not one token is produced from unverified KV.

A reservation that finds no free pages waits (bounded by --max-waiting, then 503). The next one granted is the
one the engine's fairness would admit next (engine/fairness.py: with vtc, of the tenant served least; within a
tenant by priority, then arrival; with off, arrival order), and only when it fits: no other request takes pages
ahead of it. With vtc, a reservation of a tenant within its fair share of the pool that finds no room preempts
decoding requests of the tenant most over its share (recomputed here later, their output so far kept:
engine/decode_admission.py make_room). A tenant with a kv_share holds at most that share of the pool in reservations
and requests (at their longest); its further reservations wait without holding back other tenants'. Each request's
deltas are numbered for the router's continuity check. While tenants compete (vtc), a reservation is granted to a
tenant only while its requests here stay within its fair share of the pool (decode_admission.within_fair_reservations).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvseal.auth.keys import MemberKeys
from kvseal.engine import decode_admission as admission
from kvseal.engine.engine import Engine
from kvseal.engine.kv_decode import DecodeConnector
from kvseal.errors import InternalError, KvsealError, Overloaded, TransferVerificationFailed, WorkerFailed
from kvseal.hooks import Hooks
from kvseal.transfer.base import Arrival, create_transport
from kvseal.transfer.manifest import KVManifest, page_nbytes
from kvseal.wire import protocol as P
from kvseal.wire.messages import GenerateDelta, GenerateRequest
from kvseal.wire.roles import Role
from kvseal.worker.server import WorkerServer

log = logging.getLogger("kvseal.decode")
_T = TypeVar("_T")


@dataclass(frozen=True)
class _Queued:
    ident: bytes  # the router that asked
    call_id: int
    request: GenerateRequest
    since: float = field(default_factory=time.monotonic)


@dataclass
class _Route:
    ident: bytes  # the router that streams the request
    sent: int = 0  # deltas sent: the number the next one carries


class DecodeWorker(WorkerServer):
    role = Role.DECODE

    def __init__(self, engine: Engine, bind: str, kv_bind: str, hooks: Hooks,
                 reservation_timeout_s: float = 120.0, drain_timeout_s: float = 600.0,
                 kv_transport: str = "zmq", keys: MemberKeys | None = None, kv_channel: str = "mac",
                 kv_advertise_host: str | None = None) -> None:
        super().__init__(engine, bind, hooks, drain_timeout_s, keys)
        self.kv = DecodeConnector(engine, verify_kv=self.hooks.verify_kv)
        self.kv_transport = kv_transport
        # a frame larger than the whole pool is never a real transfer: the transport drops its sender
        self.transport = create_transport(
            kv_transport, max_frame_bytes=engine.pool.num_pages * page_nbytes(engine.pool.k) + 2**20, keys=keys,
            **({"encrypt": True} if kv_channel == "curve" and kv_transport == "zmq" else {}))
        self.transport.register(engine.pool.k, engine.pool.v)
        self.kv_endpoint = self.transport.listen(kv_bind)
        if kv_advertise_host:  # bound on a wildcard (0.0.0.0 in a pod): prefill reaches it by this name, same port
            self.kv_endpoint = f"tcp://{kv_advertise_host}:{self.kv_endpoint.rsplit(':', 1)[1]}"
        self.reservation_timeout_s = reservation_timeout_s
        # request id -> the router that streams it and the number of its next delta; it outlives the request's
        # Sequence by one message (its final delta is routed after the engine let go of it)
        self.routes: dict[str, _Route] = {}
        self.queue: deque[_Queued] = deque()  # reservations waiting for pages, in arrival order (oldest first)
        self._next_expiry = 0.0

    def figures(self) -> dict[str, Any]:
        return {**super().figures(), "kv_endpoint": self.kv_endpoint,
                "kv_channel": ("mac" if getattr(self.transport, "kv_session", "") else "curve") if self.keys
                else "plain",
                "kv_landing": len(self.kv.landing), "kv_quarantined": len(self.kv.quarantined),
                **self.kv_figures(), "reservations": self.kv.num_reserved(),
                "reservations_queued": len(self.queue)}

    def reservation_timeout(self) -> float | None:
        return self.reservation_timeout_s

    def kv_figures(self) -> dict[str, int]:
        return {"kv_quarantined_pages": sum(len(s.pages) for s in self.kv.quarantined.values()),
                **self.transport.figures()}

    def handle(self, ident: bytes, msg: P.Message) -> None:
        match msg:
            case P.ReserveReq(call_id=cid, request=req):
                self.counters["requests_received"] += 1
                try:
                    self.refuse_new()
                    self.engine.scheduler.fair.seen(req.tenant, req.weight, time.monotonic())
                    if self.queue or not self._fits_now(req) or not self._may_reserve(req):
                        self._enqueue(_Queued(ident, cid, req))
                        return
                    self._reserve(_Queued(ident, cid, req))
                except KvsealError as err:
                    self.send(ident, P.ReserveResp(call_id=cid, error=err.to_info()))
            case P.ReleaseReq(request_id=rid, error=err, rejected=rejected):
                self._dequeue(rid)
                self.kv.release(rid, KvsealError.from_info(err), rejected)
            case P.RenewReq(request_id=rid):
                self.kv.renew(rid, time.monotonic() + self.reservation_timeout_s)
            case P.AbortReq(request_id=rid, error=err):
                self._dequeue(rid)
                self.engine.abort(rid, KvsealError.from_info(err))
            case _:
                super().handle(ident, msg)

    # -- reservations in arrival order -----------------------------------------------------------------
    def _fits_now(self, req: GenerateRequest) -> bool:
        e = self.engine
        return admission.pages_available(e, req) >= admission.pages_for_prompt(e, len(req.prompt_ids))

    def _may_reserve(self, req: GenerateRequest) -> bool:
        return admission.within_share(self.engine, req) and admission.within_fair_reservations(self.engine, req)

    def _fits_with_room(self, req: GenerateRequest) -> bool:
        """It fits now, or (vtc) once requests of tenants over their fair share were preempted for it."""
        return self._fits_now(req) or admission.make_room(self.engine, req)

    def _enqueue(self, q: _Queued) -> None:
        limit = self.engine.cfg.scheduler.max_waiting
        if len(self.queue) >= limit:
            raise Overloaded(f"the decode worker has {len(self.queue)} requests waiting for KV pages "
                             f"(--max-waiting {limit}); retry later")
        self.engine.validate(len(q.request.prompt_ids), q.request.params.max_tokens)  # never fits: at once
        self.queue.append(q)

    def _dequeue(self, rid: str) -> None:
        for q in self.queue:
            if q.request.request_id == rid:
                self.queue.remove(q)
                return

    def _reserve(self, q: _Queued) -> None:
        res = self.kv.reserve(q.request, self.reservation_timeout_s, self.kv_endpoint,
                                   self.keys.public if self.keys is not None else "",
                                   getattr(self.transport, "kv_session", ""))
        self.routes[q.request.request_id] = _Route(q.ident)
        self.send(q.ident, P.ReserveResp(call_id=q.call_id, reservation=res))

    def _next_queued(self) -> _Queued | None:
        """The reservation to grant next: of those whose tenant stays within its kv_share, the one fairness picks
        (a tenant at its share waits without holding back the others)."""
        ready = [q for q in self.queue if self._may_reserve(q.request)]
        if not ready:
            return None
        held = Counter(s.tenant for s in self.engine.seqs.values())  # running, reserved, landing
        return self.engine.scheduler.fair.pick(ready, lambda q: (
            q.request.tenant, q.request.priority_class, q.request.priority, q.since), held)

    def _grant_queued(self) -> None:
        while (q := self._next_queued()) is not None and self._fits_with_room(q.request):
            self.queue.remove(q)
            try:
                self._reserve(q)
            except KvsealError as err:
                self.send(q.ident, P.ReserveResp(call_id=q.call_id, error=err.to_info()))
        # a queue that moves is never timed out; one where no page was freed for wait_timeout_s cannot move
        limit = self.engine.cfg.scheduler.wait_timeout_s
        now = time.monotonic()
        while self.queue and now - max(self.queue[0].since, self.engine.scheduler.last_freed) > limit:
            q = self.queue.popleft()
            self.send(q.ident, P.ReserveResp(call_id=q.call_id, error=Overloaded(
                f"no KV pages were freed on the decode worker for {limit:g}s; retry later").to_info()))

    # -- the loop --------------------------------------------------------------------------------------
    def pump(self) -> None:
        while (arrival := self.transport.recv(0, self._claim)) is not None:
            self._arrive(arrival)
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + 0.5
            self.kv.expire_reservations(now)
        self._grant_queued()

    def _claim(self, manifest: KVManifest) -> list[int]:
        """For an in-place transport: the reserved pages the KV may land in (pinned), or the refusal."""
        return self._checked(manifest.request_id, "claiming pages for",
                             lambda: self.kv.claim(manifest))

    def _arrive(self, a: Arrival) -> None:
        rid = a.manifest.request_id
        if a.still_landing:  # past its deadline, the read still runs: the request ends, its pages stay claimed
            assert a.error is not None
            log.warning("KV of %r is late: %s", rid, a.error.message)
            self.engine.fail(rid, KvsealError.from_info(a.error))
            return
        if a.error is not None:  # the claimed pages' bytes did not all land: scrubbed and freed, request FAILED
            log.warning("KV of %r did not arrive: %s", rid, a.error.message)
            self.kv.landing_failed(rid, KvsealError.from_info(a.error))
            self.counters["transfers_refused"] += 1
            a.reply(False, a.error)
            return
        if a.landed is not None and rid in self.kv.quarantined:  # ended while landing: nothing to verify
            self.kv.landing_failed(rid, WorkerFailed(f"request {rid!r} ended while its KV was landing"))
            self.counters["transfers_refused"] += 1
            a.reply(False, WorkerFailed(f"request {rid!r} ended on the decode worker while its KV was landing; "
                                        f"its pages were scrubbed and freed").to_info())
            return
        self.counters["kv_bytes_received"] += (a.payload or a.landed).nbytes  # type: ignore[union-attr]

        def accept() -> None:
            if a.landed is not None:
                self.kv.accept_landed(a.manifest)
            else:
                assert a.payload is not None
                self.kv.accept(a.manifest, a.payload)

        try:
            self._checked(rid, "accepting", accept)
        except KvsealError as err:
            a.reply(False, err.to_info())
            return
        a.reply(True)
        self.counters["transfers_acked"] += 1

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

    def route(self, out: list[GenerateDelta]) -> None:
        for d in out:
            route = self.routes.get(d.request_id)
            if route is None:
                continue
            if d.final is not None:
                del self.routes[d.request_id]
            self.send(route.ident, P.DeltaMsg(delta=d, seq=route.sent))
            route.sent += 1

    def peer_lost(self, ident: bytes) -> None:
        err = WorkerFailed("the router stopped reading this request's output; it ended on the decode worker")
        for q in [q for q in self.queue if q.ident == ident]:
            self.queue.remove(q)
        for rid in [rid for rid, r in self.routes.items() if r.ident == ident]:
            del self.routes[rid]  # its final delta has nowhere to go
            self.engine.fail(rid, err)

    def inflight(self) -> int:
        return len(self.engine.seqs) + len(self.queue)

    def queued(self) -> int:
        return len(self.queue)

    def is_live(self, request_id: str) -> bool:
        return request_id in self.engine.seqs or any(q.request.request_id == request_id for q in self.queue)

    def sent_deltas(self, request_id: str) -> int:
        route = self.routes.get(request_id)
        return 0 if route is None else route.sent

    def close(self) -> None:
        self.transport.close()
        super().close()

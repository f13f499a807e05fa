"""The decode worker: reserve pages, receive KV, verify it against the reservation, then decode.

A request joins a batch only after every manifest field and every page checksum matched its reservation
(seal 4). A mismatch nacks the sender, FAILS the request with the verification error, scrubs and frees
the reserved pages, and tells the router; not one token is produced from unverified KV.
"""

from __future__ import annotations

import logging
import time

from kvseal.engine.disagg import DecodeEngine
from kvseal.engine.messages import GenerateDelta
from kvseal.errors import KvsealError, TransferVerificationFailed
from kvseal.faults import Faults
from kvseal.transfer.base import Arrival
from kvseal.transfer.zmq import ZmqTransport
from kvseal.worker import protocol as P
from kvseal.worker.server import WorkerServer

log = logging.getLogger("kvseal.decode")


class DecodeWorker(WorkerServer):
    role = "decode"

    def __init__(self, engine: DecodeEngine, bind: str, kv_bind: str, faults: Faults,
                 reservation_timeout_s: float = 120.0) -> None:
        super().__init__(engine, bind, faults)
        self.dengine = engine
        self.transport = ZmqTransport()
        self.transport.register(engine.pool.k, engine.pool.v)
        self.kv_endpoint = self.transport.listen(kv_bind)
        self.reservation_timeout_s = reservation_timeout_s
        self.owners: dict[str, bytes] = {}  # request id -> the router that streams it
        self._next_expiry = 0.0

    def info(self) -> dict[str, object]:
        return {**super().info(), "kv_endpoint": self.kv_endpoint, "reservations": len(self.dengine.reserved),
                "reservation_timeout_s": self.reservation_timeout_s}

    def handle(self, ident: bytes, msg: P.Message) -> None:
        match msg:
            case P.ReserveReq(call_id=cid, request=req):
                self.counters["requests_received"] += 1
                try:
                    res = self.dengine.reserve(req, self.reservation_timeout_s, self.kv_endpoint)
                except KvsealError as err:
                    self.send(ident, P.ReserveResp(call_id=cid, error=err.to_info()))
                    return
                self.owners[req.request_id] = ident
                self.send(ident, P.ReserveResp(call_id=cid, reservation=res))
            case P.ReleaseReq(request_id=rid, error=err, rejected=rejected):
                self.dengine.release(rid, KvsealError.from_info(err), rejected)
            case P.RenewReq(request_id=rid):
                self.dengine.renew(rid, time.monotonic() + self.reservation_timeout_s)
            case _:
                super().handle(ident, msg)

    def pump(self) -> None:
        while (arrival := self.transport.recv(0)) is not None:
            self._arrive(arrival)
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + 0.5
            self.dengine.expire_reservations(now)

    def _arrive(self, a: Arrival) -> None:
        self.counters["kv_bytes_received"] += a.payload.nbytes
        try:
            # the incident fault (test-only) puts back the 2026 bug: no verification
            self.dengine.accept(a.manifest, a.payload, check=not self.faults.incident)
        except TransferVerificationFailed as err:
            log.warning("refusing KV: %s", err.message)
            self.counters["transfers_refused"] += 1
            a.reply(False, err.to_info())
            return
        a.reply(True)
        self.counters["transfers_acked"] += 1

    def route(self, out: list[GenerateDelta]) -> None:
        for d in out:
            ident = self.owners.get(d.request_id)
            if ident is None:
                continue
            if d.final is not None:
                self.owners.pop(d.request_id, None)
            self.send(ident, P.DeltaMsg(delta=d))

    def close(self) -> None:
        self.transport.close()
        super().close()



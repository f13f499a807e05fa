"""The decode worker: reserve pages, receive KV, verify it against the reservation, then decode.

A request joins a batch only after every manifest field and every page checksum matched its reservation
(seal 4). A mismatch nacks the sender, FAILS the request with the verification error, scrubs and frees
the reserved pages, and tells the router; not one token is produced from unverified KV.
"""

from __future__ import annotations

import logging
import time

from kvseal.engine.disagg import DecodeEngine
from kvseal.engine.messages import GenerateDelta, TokenLogprob
from kvseal.errors import KvsealError, TransferVerificationFailed
from kvseal.faults import Faults
from kvseal.transfer.base import Arrival
from kvseal.transfer.manifest import (
    Reservation,
    dtype_name,
    new_nonce,
    new_reservation_id,
    page_nbytes,
    unpack_into,
    verify,
)
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
        self.reservations: dict[str, Reservation] = {}
        self.owners: dict[str, bytes] = {}  # request id -> the router that streams it
        self._next_expiry = 0.0

    def info(self) -> dict[str, object]:
        return {**super().info(), "kv_endpoint": self.kv_endpoint, "reservations": len(self.reservations)}

    def handle(self, ident: bytes, msg: P.Message) -> None:
        match msg:
            case P.ReserveReq(call_id=cid, request=req):
                self.counters["requests_received"] += 1
                try:
                    seq = self.dengine.reserve(req, self.reservation_timeout_s)
                except KvsealError as err:
                    self.send(ident, P.ReserveResp(call_id=cid, error=err.to_info()))
                    return
                e = self.dengine
                res = Reservation(
                    request_id=req.request_id, reservation_id=new_reservation_id(), nonce=new_nonce(),
                    num_tokens=len(req.prompt_ids), page_ids=list(seq.pages), model_fingerprint=e.fingerprint,
                    page_size=e.pool.page_size, kv_dtype=dtype_name(e.dtype), kv_layout=str(e.info()["kv_layout"]),
                    kv_endpoint=self.kv_endpoint)
                self.reservations[req.request_id] = res
                self.owners[req.request_id] = ident
                self.send(ident, P.ReserveResp(call_id=cid, reservation=res))
            case P.ReleaseReq(request_id=rid, error=err, rejected=rejected):
                self.reservations.pop(rid, None)
                self.dengine.release(rid, KvsealError.from_info(err), rejected)
            case P.AbortReq(request_id=rid, error=err):
                self.reservations.pop(rid, None)
                self.engine.abort(rid, KvsealError.from_info(err))
            case _:
                super().handle(ident, msg)

    def pump(self) -> None:
        while (arrival := self.transport.recv(0)) is not None:
            self._arrive(arrival)
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + 0.5
            self.dengine.expire_reservations(now)
            for rid in [r for r in self.reservations if r not in self.dengine.reserved]:
                self.reservations.pop(rid, None)

    def _arrive(self, a: Arrival) -> None:
        m = a.manifest
        self.counters["kv_bytes_received"] += a.payload.nbytes
        res = self.reservations.get(m.request_id)
        if res is None or self.dengine.begin_transfer(m.request_id) is None:
            a.reply(False, TransferVerificationFailed(
                f"KV arrived for request {m.request_id!r}, which holds no reservation here").to_info())
            self.counters["transfers_refused"] += 1
            return
        try:
            if not self.faults.incident:  # test-only: the 2026 bug skipped this check
                verify(m, res, a.payload, expected_fingerprint=self.dengine.fingerprint,
                       page_bytes=page_nbytes(self.dengine.pool.k))
        except TransferVerificationFailed as err:
            log.warning("refusing KV: %s", err.message)
            self.counters["transfers_refused"] += 1
            a.reply(False, err.to_info())
            self.reservations.pop(m.request_id, None)
            self.dengine.release(m.request_id, err, rejected=False)
            return
        unpack_into(self.dengine.pool.k, self.dengine.pool.v, res.page_ids[: a.payload.num_pages], a.payload)
        a.reply(True)
        self.counters["transfers_acked"] += 1
        self.reservations.pop(m.request_id, None)
        lp = None if m.first_logprob is None else TokenLogprob(m.first_token, m.first_logprob, list(m.first_top))
        self.dengine.admit_verified(m.request_id, m.first_token, lp)

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



"""The prefill worker: admit, chunked prefill, first token, then hand the KV to the reserving decode worker.

A request refused here (too long for this pool, or any other reason) is answered with its original error
before a single KV byte moves (seal 3); the router then releases the decode reservation with that error.
Pages are scrubbed and freed when decode acknowledges, or when the handoff fails or times out.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvseal.auth.keys import MemberKeys
from kvseal.engine.engine import Engine
from kvseal.engine.kv_prefill import PrefillConnector
from kvseal.engine.sequence import Route, Sequence
from kvseal.errors import InvalidRequest, KvsealError, WorkerFailed
from kvseal.hooks import Hooks
from kvseal.transfer.base import TransferState, create_transport
from kvseal.wire import protocol as P
from kvseal.wire.messages import GenerateDelta
from kvseal.wire.roles import Role
from kvseal.worker.server import WorkerServer

log = logging.getLogger("kvseal.prefill")


class PrefillWorker(WorkerServer):
    role = Role.PREFILL

    def __init__(self, engine: Engine, bind: str, hooks: Hooks, transfer_timeout_s: float = 60.0,
                 drain_timeout_s: float = 600.0, kv_transport: str = "zmq", keys: MemberKeys | None = None) -> None:
        super().__init__(engine, bind, hooks, drain_timeout_s, keys)
        self.kv = engine.connector(PrefillConnector)
        self.kv_transport = kv_transport
        mutate = self.hooks.outgoing_kv if hooks.spec else None
        # NIXL: each decode worker reads from an export window of its own, never from the pool (transfer/nixl.py)
        extra = {"export_pages": self.kv.export_pages()} if kv_transport == "nixl" else {}
        self.transport = create_transport(kv_transport, timeout_s=transfer_timeout_s, mutate=mutate, keys=keys,
                                          **extra)
        self.kv.register(self.transport)

    def figures(self) -> dict[str, Any]:
        return {**super().figures(), **self.kv_figures()}

    def kv_figures(self) -> dict[str, int]:
        return self.transport.figures()

    def handle(self, ident: bytes, msg: P.Message) -> None:
        # While draining, a PrefillReq is still taken: it continues a request the router already started (its
        # decode pages are reserved); the router sends no new one once it has the DrainNotice.
        match msg:
            case P.PrefillReq(call_id=cid, request=req, reservation=res):
                self.counters["requests_received"] += 1
                if self.engine.is_live(req.request_id):
                    raise InvalidRequest(f"request {req.request_id} is already being prefilled")
                try:
                    req = self.hooks.admit_prefill(req, self.engine.context_window)
                except KvsealError as err:
                    self.send(ident, P.PrefillResp(call_id=cid, request_id=req.request_id, state="rejected",
                                                   error=err.to_info()))
                    return
                self.kv.prefill(req, Route(ident, cid), res)
            case P.AbortReq(request_id=rid, error=err):
                seq = self.engine.request(rid)
                if seq is not None:
                    self._forget_route(seq)  # aborted by its router: nothing to answer
                self.engine.abort(rid, KvsealError.from_info(err))
            case _:
                super().handle(ident, msg)

    def busy(self) -> bool:
        """Handoffs the worker took: held back by a hook, or in flight."""
        return any(s.handoff is not None and s.handoff.due is not None for s in self.kv.handoffs())

    def peer_lost(self, ident: bytes) -> None:
        err = WorkerFailed("the router stopped reading; this request ended on the prefill worker")
        for seq in self.engine.routed_to(ident):
            self._forget_route(seq)
            self.engine.fail(seq.request_id, err)

    def route(self, out: list[tuple[Sequence, GenerateDelta]]) -> None:
        # A prefill engine emits deltas only for requests that ended before any handoff (rejected,
        # aborted, failed): answer with the original error. Nothing was sent for them.
        for seq, d in out:
            if d.final is not None and d.error is not None:
                self._answer(seq, d.final, KvsealError.from_info(d.error))

    def pump(self) -> None:
        self.transport.tend()  # late answers from decode release the pages it was offered
        now = time.monotonic()
        for seq in self.kv.take_ready():  # handed off this turn: the router hears it; a hook may hold it back
            assert seq.handoff is not None and seq.route is not None
            self.send(seq.route.ident, P.HandoffStarted(request_id=seq.request_id))
            seq.handoff.due = now + self.hooks.hold_handoff_s()
        for seq in self.kv.handoffs():
            assert seq.handoff is not None
            if seq.handoff.transfer is None and seq.handoff.due is not None and seq.handoff.due <= now:
                self._send(seq)
            if seq.handoff.transfer is not None:
                self._poll(seq)

    def _send(self, seq: Sequence) -> None:
        h, res = seq.handoff, seq.reservation
        assert h is not None and res is not None
        manifest, payload = self.kv.package(seq, res, staged=self.transport.staged)
        h.transfer = self.transport.send(res.kv_endpoint, manifest, payload, server_key=res.kv_key or None,
                                         session=res.kv_session or None)
        h.nbytes, h.cached_tokens, h.sent_at = payload.nbytes, seq.cached_tokens, time.monotonic()
        self.counters["kv_bytes_sent"] += payload.nbytes

    def _poll(self, seq: Sequence) -> None:
        """Decode's answer: acknowledged (decode owns the request now: pages freed, the router answered) or refused
        (FAILED here too, pages freed; route() answers the router with decode's original error)."""
        h = seq.handoff
        assert h is not None and h.transfer is not None
        status = self.transport.poll(h.transfer)
        if not status.done:
            return
        if status.state is TransferState.ACKED:
            self.counters["transfers_acked"] += 1
            self.metrics.transfer_seconds.observe(time.monotonic() - h.sent_at)
            self.kv.end_handoff(seq.request_id, None)
            self._answer(seq, "handed_off", None)
        else:
            self.counters["transfers_refused"] += 1
            assert status.error is not None
            self.kv.end_handoff(seq.request_id, KvsealError.from_info(status.error))

    def _answer(self, seq: Sequence, state: str, err: KvsealError | None) -> None:
        """The router's one answer for seq (PrefillResp)."""
        route, h = seq.route, seq.handoff
        if route is None:
            return
        self._forget_route(seq)
        self.send(route.ident, P.PrefillResp(call_id=route.call_id, request_id=seq.request_id, state=state,
                                             error=None if err is None else err.to_info(),
                                             kv_bytes_sent=0 if h is None else h.nbytes,
                                             cached_tokens=0 if h is None else h.cached_tokens))

    def _forget_route(self, seq: Sequence) -> None:
        """seq's router is answered, or asks for nothing more: a transfer in flight is dropped (a late answer from
        decode changes nothing now)."""
        seq.route = None
        if seq.handoff is not None and seq.handoff.transfer is not None:
            self.transport.abort(seq.handoff.transfer)

    def close(self) -> None:
        self.transport.close()
        super().close()

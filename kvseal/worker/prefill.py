"""The prefill worker: admit, chunked prefill, first token, then hand the KV to the reserving decode worker.

A request refused here (too long for this pool, or any other reason) is answered with its original error
before a single KV byte moves (seal 3); the router then releases the decode reservation with that error.
Pages are scrubbed and freed when decode acknowledges, or when the handoff fails or times out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from kvseal.auth.keys import MemberKeys
from kvseal.engine.engine import Engine
from kvseal.engine.kv_prefill import PrefillConnector
from kvseal.engine.sequence import Sequence
from kvseal.errors import InvalidRequest, KvsealError, WorkerFailed
from kvseal.hooks import Hooks
from kvseal.kv.allocator import pages_for
from kvseal.transfer.base import TransferHandle, TransferState, create_transport
from kvseal.wire import protocol as P
from kvseal.wire.messages import GenerateDelta
from kvseal.wire.reservation import Reservation
from kvseal.wire.roles import Role
from kvseal.worker.server import WorkerServer

log = logging.getLogger("kvseal.prefill")


@dataclass
class _Job:
    ident: bytes  # the router that asked
    call_id: int
    reservation: Reservation
    handle: TransferHandle | None = None
    nbytes: int = 0
    cached_tokens: int = 0
    sent_at: float = 0.0


class PrefillWorker(WorkerServer):
    role = Role.PREFILL

    def __init__(self, engine: Engine, bind: str, hooks: Hooks, transfer_timeout_s: float = 60.0,
                 drain_timeout_s: float = 600.0, kv_transport: str = "zmq", keys: MemberKeys | None = None) -> None:
        super().__init__(engine, bind, hooks, drain_timeout_s, keys)
        self.kv = PrefillConnector(engine)
        self.kv_transport = kv_transport
        mutate = self.hooks.outgoing_kv if hooks.spec else None
        # NIXL: each decode worker reads from an export window of its own, never from the pool (transfer/nixl.py)
        extra = {"export_pages": export_pages(engine)} if kv_transport == "nixl" else {}
        self.transport = create_transport(kv_transport, timeout_s=transfer_timeout_s, mutate=mutate, keys=keys,
                                          **extra)
        self.transport.register(engine.pool.k, engine.pool.v)
        self.jobs: dict[str, _Job] = {}
        self._held: list[tuple[float, Sequence]] = []  # handoffs a hook holds back (hold_handoff_s)

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
                rid = req.request_id
                if rid in self.jobs or rid in self.engine.seqs:
                    raise InvalidRequest(f"request {rid} is already being prefilled")
                self.jobs[rid] = _Job(ident, cid, res)
                try:
                    req = self.hooks.admit_prefill(req, self.engine.context_window)
                except KvsealError as err:
                    self._answer(rid, "rejected", err)
                    return
                self.engine.add_request(req)
                if self.engine.forensics is not None and rid in self.engine.seqs:
                    self.engine.forensics.log_of(self.engine.seqs[rid]).reservation_id = res.reservation_id
            case P.AbortReq(request_id=rid, error=err):
                job = self.jobs.pop(rid, None)
                if job is not None and job.handle is not None:
                    self.transport.abort(job.handle)
                self.engine.abort(rid, KvsealError.from_info(err))
            case _:
                super().handle(ident, msg)

    def busy(self) -> bool:
        return bool(self._held) or any(j.handle is not None for j in self.jobs.values())

    def inflight(self) -> int:
        return len(self.engine.seqs) + len(self.jobs)

    def is_live(self, request_id: str) -> bool:
        return request_id in self.engine.seqs or request_id in self.jobs

    def peer_lost(self, ident: bytes) -> None:
        err = WorkerFailed("the router stopped reading; this request ended on the prefill worker")
        for rid in [rid for rid, job in self.jobs.items() if job.ident == ident]:
            job = self.jobs.pop(rid)
            if job.handle is not None:
                self.transport.abort(job.handle)
            self.engine.fail(rid, err)

    def route(self, out: list[GenerateDelta]) -> None:
        # A prefill engine emits deltas only for requests that ended before any handoff (rejected,
        # aborted, failed): answer with the original error. Nothing was sent for them.
        for d in out:
            if d.final is not None and d.error is not None:
                self._answer(d.request_id, d.final, KvsealError.from_info(d.error))

    def pump(self) -> None:
        self.transport.tend()  # late answers from decode release the pages it was offered
        now = time.monotonic()
        ready = self.kv.take_ready()
        for seq in ready:
            job = self.jobs.get(seq.request_id)
            if job is not None:
                self.send(job.ident, P.HandoffStarted(request_id=seq.request_id))
        self._held += [(now + self.hooks.hold_handoff_s(), seq) for seq in ready]
        due = [seq for t, seq in self._held if t <= now]
        self._held = [(t, seq) for t, seq in self._held if t > now]
        for seq in due:
            self._send(seq)
        for rid, job in list(self.jobs.items()):
            if job.handle is None:
                continue
            status = self.transport.poll(job.handle)
            if not status.done:
                continue
            if status.state is TransferState.ACKED:
                self.counters["transfers_acked"] += 1
                self.metrics.transfer_seconds.observe(time.monotonic() - job.sent_at)
                self.kv.end_handoff(rid, None)
                self._answer(rid, "handed_off", None)
            else:
                self.counters["transfers_refused"] += 1
                assert status.error is not None
                # FAILED here too, pages freed; route() answers the router with decode's original error
                self.kv.end_handoff(rid, KvsealError.from_info(status.error))

    def _send(self, seq: Sequence) -> None:
        rid = seq.request_id
        job = self.jobs.get(rid)
        if job is None:  # aborted meanwhile
            self.kv.end_handoff(rid, None)
            return
        if seq.handoff is None:  # ended while a hook held it back
            return
        manifest, payload = self.kv.package(seq, job.reservation, staged=self.transport.staged)
        job.handle = self.transport.send(job.reservation.kv_endpoint, manifest, payload,
                                         server_key=job.reservation.kv_key or None,
                                         session=job.reservation.kv_session or None)
        job.nbytes, job.cached_tokens, job.sent_at = payload.nbytes, seq.cached_tokens, time.monotonic()
        self.counters["kv_bytes_sent"] += payload.nbytes

    def _answer(self, rid: str, state: str, err: KvsealError | None) -> None:
        job = self.jobs.pop(rid, None)
        if job is None:
            return
        if job.handle is not None:
            self.transport.abort(job.handle)  # a late answer from decode changes nothing now
        self.send(job.ident, P.PrefillResp(call_id=job.call_id, request_id=rid, state=state,
                                           error=None if err is None else err.to_info(), kv_bytes_sent=job.nbytes,
                                           cached_tokens=job.cached_tokens))

    def close(self) -> None:
        self.transport.close()
        super().close()


def export_pages(engine: Engine) -> int:
    """Pages of the NIXL export window for each decode worker: room for two prompts of the whole context window,
    or a quarter of the pool if that is more, never more than the pool. An offer that finds it full waits for
    decode's answers (up to the transfer timeout); memory: this many pages per decode worker, beside the pool."""
    pool = engine.pool.num_pages
    return min(pool, max(2 * pages_for(engine.context_window, engine.pool.page_size), pool // 4))

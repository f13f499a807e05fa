"""The prefill worker: admit, chunked prefill, first token, then hand the KV to the reserving decode worker.

A request refused here (too long for this pool, or any other reason) is answered with its original error
before a single KV byte moves (seal 3); the router then releases the decode reservation with that error.
Pages are scrubbed and freed when decode acknowledges, or when the handoff fails or times out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec

from kvseal.engine.disagg import Handoff, PrefillEngine
from kvseal.engine.messages import GenerateDelta
from kvseal.errors import InvalidRequest, KvsealError
from kvseal.faults import Faults
from kvseal.transfer.base import TransferHandle, TransferState
from kvseal.transfer.manifest import Reservation
from kvseal.transfer.zmq import ZmqTransport
from kvseal.worker import protocol as P
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


class PrefillWorker(WorkerServer):
    role = "prefill"

    def __init__(self, engine: PrefillEngine, bind: str, faults: Faults, transfer_timeout_s: float = 60.0) -> None:
        super().__init__(engine, bind, faults)
        self.pengine = engine
        mutate = (lambda m, p: self.faults.mutate(m, p)) if faults.any else None
        self.transport = ZmqTransport(timeout_s=transfer_timeout_s, mutate=mutate)
        self.transport.register(engine.pool.k, engine.pool.v)
        self.jobs: dict[str, _Job] = {}
        self._stalled: list[tuple[float, Handoff]] = []  # test-only stall_transfer fault

    def handle(self, ident: bytes, msg: P.Message) -> None:
        match msg:
            case P.PrefillReq(call_id=cid, request=req, reservation=res):
                self.counters["requests_received"] += 1
                rid = req.request_id
                if rid in self.jobs:
                    raise InvalidRequest(f"request {rid} is already being prefilled")
                self.jobs[rid] = _Job(ident, cid, res)
                over = self.faults.prefill_reject_over
                if over is not None and len(req.prompt_ids) > over:
                    self._answer(rid, "rejected", InvalidRequest(
                        f"prefill worker policy refused a prompt of {len(req.prompt_ids)} tokens "
                        f"(limit {over})", code="prefill_policy"))
                    return
                if self.faults.incident and len(req.prompt_ids) + req.params.max_tokens > self.engine.context_window:
                    # THE 2026 BUG, test-only: "reject" by swapping in a one-token placeholder that keeps flowing
                    req = msgspec.structs.replace(req, prompt_ids=req.prompt_ids[:1],
                                                  params=msgspec.structs.replace(req.params, max_tokens=1))
                self.engine.add_request(req)
            case P.AbortReq(request_id=rid, error=err):
                job = self.jobs.pop(rid, None)
                if job is not None and job.handle is not None:
                    self.transport.abort(job.handle)
                self.engine.abort(rid, KvsealError.from_info(err))
            case _:
                super().handle(ident, msg)

    def busy(self) -> bool:
        return bool(self._stalled) or any(j.handle is not None for j in self.jobs.values())

    def route(self, out: list[GenerateDelta]) -> None:
        # A prefill engine emits deltas only for requests that ended before any handoff (rejected,
        # aborted, failed): answer with the original error. Nothing was sent for them.
        for d in out:
            if d.final is not None and d.error is not None:
                self._answer(d.request_id, d.final, KvsealError.from_info(d.error))

    def pump(self) -> None:
        now = time.monotonic()
        ready = self.pengine.take_ready()
        for h in ready:
            job = self.jobs.get(h.seq.request_id)
            if job is not None:
                self.send(job.ident, P.HandoffStarted(request_id=h.seq.request_id))
        self._stalled += [(now + self.faults.stall_transfer_s, h) for h in ready]
        due = [h for t, h in self._stalled if t <= now]
        self._stalled = [(t, h) for t, h in self._stalled if t > now]
        for h in due:
            self._send(h)
        for rid, job in list(self.jobs.items()):
            if job.handle is None:
                continue
            status = self.transport.poll(job.handle)
            if not status.done:
                continue
            if status.state is TransferState.ACKED:
                self.counters["transfers_acked"] += 1
                self.pengine.end_handoff(rid, None)
                self._answer(rid, "handed_off", None)
            else:
                self.counters["transfers_refused"] += 1
                assert status.error is not None
                # FAILED here too, pages freed; route() answers the router with decode's original error
                self.pengine.end_handoff(rid, KvsealError.from_info(status.error))

    def _send(self, h: Handoff) -> None:
        rid = h.seq.request_id
        job = self.jobs.get(rid)
        if job is None:  # aborted meanwhile
            self.pengine.end_handoff(rid, None)
            return
        manifest, payload = self.pengine.package(h, job.reservation)
        job.handle = self.transport.send(job.reservation.kv_endpoint, manifest, payload)
        job.nbytes, job.cached_tokens = payload.nbytes, h.seq.cached_tokens
        self.counters["kv_bytes_sent"] += payload.nbytes

    def _answer(self, rid: str, state: str, err: KvsealError | None) -> None:
        job = self.jobs.pop(rid, None)
        if job is None:
            return
        self.send(job.ident, P.PrefillResp(call_id=job.call_id, request_id=rid, state=state,
                                           error=None if err is None else err.to_info(), kv_bytes_sent=job.nbytes,
                                           cached_tokens=job.cached_tokens))

    def close(self) -> None:
        self.transport.close()
        super().close()

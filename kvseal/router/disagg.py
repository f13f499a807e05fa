"""The disaggregated backend: drive each request through reserve -> prefill -> verified handoff -> decode.

The router keeps the request's one Lifecycle. It never yields a token before decode verified the handoff
(decode only streams after verification), a prefill refusal releases the decode reservation and reaches
the client with its original error (seal 3), and every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
import zmq.asyncio

from kvseal.engine.messages import GenerateDelta, GenerateRequest
from kvseal.errors import (
    CapacityMismatch,
    ErrorInfo,
    KvsealError,
    Overloaded,
    RequestAborted,
    TransferTimeout,
    WorkerFailed,
)
from kvseal.lifecycle import FinishReason, Lifecycle, State
from kvseal.model.tokenizer import Tokenizer
from kvseal.router.affinity import PrefixAffinity
from kvseal.router.registry import check_fleet, served_window
from kvseal.router.workers import WorkerClient
from kvseal.worker import protocol as P

log = logging.getLogger("kvseal.router")


class DisaggBackend:
    def __init__(self, tokenizer: Tokenizer, model_name: str | None, prefill: list[str], decode: list[str],
                 max_model_len: int | None = None, startup_timeout_s: float = 300.0,
                 handoff_timeout_s: float = 600.0, stall_timeout_s: float = 120.0, renew_every_s: float = 10.0,
                 wait_timeout_s: float = 60.0, capacity_check: bool = True) -> None:
        self.tokenizer = tokenizer
        self._name = model_name
        self.model_name = model_name or ""
        self.prefill_eps, self.decode_eps = prefill, decode
        self.max_model_len = max_model_len
        self.startup_timeout_s, self.handoff_timeout_s = startup_timeout_s, handoff_timeout_s
        self.stall_timeout_s, self.wait_timeout_s = stall_timeout_s, wait_timeout_s
        self.renew_every_s = renew_every_s  # at most this, and at most a quarter of decode's reservation timeout
        self.context_window = 0
        self.capacity_check = capacity_check  # False only under the test-only incident fault
        self.prefills: list[WorkerClient] = []
        self.decodes: list[WorkerClient] = []
        self.lifecycles: dict[str, Lifecycle] = {}  # live requests only
        self.ended: dict[str, int] = {s.value: 0 for s in (State.FINISHED, State.REJECTED, State.ABORTED,
                                                           State.FAILED)}
        self._ctx: zmq.asyncio.Context | None = None
        self.affinity = PrefixAffinity()  # which prefill worker likely holds a prompt's prefix

    # -- fleet ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self.prefills = [WorkerClient("prefill", ep, self._ctx) for ep in self.prefill_eps]
        self.decodes = [WorkerClient("decode", ep, self._ctx) for ep in self.decode_eps]
        workers = self.prefills + self.decodes
        for w in workers:
            w.start()
        deadline = time.monotonic() + self.startup_timeout_s
        for w in workers:
            while True:
                try:
                    await w.fetch_info(timeout=2.0)
                    break
                except WorkerFailed:
                    if time.monotonic() > deadline:
                        raise WorkerFailed(f"{w.name} did not come up within {self.startup_timeout_s:g}s")
        infos = [(w.name, w.info) for w in workers]
        try:
            self.context_window = served_window(infos, self.max_model_len)
            check_fleet(infos, self.context_window)
        except CapacityMismatch as err:
            if not self.capacity_check:  # the 2026 behaviour, test-only: a warning, and serve anyway
                log.warning("capacity mismatch ignored (incident fault on): %s", err.message)
            else:
                log.error("refusing to start: %s", err.message)
                raise
        self.model_name = self._name or str(workers[0].info["model"])
        log.info("serving %s from %d prefill and %d decode workers; context window %d tokens",
                 self.model_name, len(self.prefills), len(self.decodes), self.context_window)

    async def stop(self) -> None:
        for w in self.prefills + self.decodes:
            await w.close()
        if self._ctx is not None:
            self._ctx.term()

    async def healthy(self) -> bool:
        return any(w.alive for w in self.prefills) and any(w.alive for w in self.decodes)

    async def info(self) -> dict[str, Any]:
        # fresh from every live worker (the heartbeat's copy may be a second old); a worker that does not
        # answer within 2 s is shown with its last known figures and alive as the heartbeat last saw it
        live = [w for w in self.prefills + self.decodes if w.alive]
        await asyncio.gather(*(w.fetch_info(timeout=2.0) for w in live), return_exceptions=True)
        workers = [{"role": w.role, "endpoint": w.endpoint, "alive": w.alive, "inflight": w.inflight,
                    **w.info} for w in self.prefills + self.decodes]
        return {"role": "router", "model": self.model_name, "context_window": self.context_window,
                "model_fingerprint": workers[0].get("model_fingerprint"),
                "pool_tokens": min(int(w.get("pool_tokens", 0)) for w in workers),
                "page_size": workers[0].get("page_size"), "kv_dtype": workers[0].get("kv_dtype"),
                "live_requests": len(self.lifecycles), "ended": dict(self.ended),
                "routed_by_prefix": self.affinity.routed_by_prefix, "workers": workers}

    def _pick(self, pool: list[WorkerClient], req: GenerateRequest | None = None) -> WorkerClient:
        """The least loaded live worker (ties at random); for prefill with `req`, the one most likely to hold
        the prompt's prefix in its cache unless that one is much busier (router/affinity.py)."""
        live = [w for w in pool if w.alive]
        if not live:
            raise WorkerFailed(f"no live {pool[0].role} worker")
        if req is not None:
            return self.affinity.pick(live, req, int(live[0].info.get("page_size", 16)))
        least = min(w.inflight for w in live)
        return random.choice([w for w in live if w.inflight == least])

    # -- one request ----------------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        rid = req.request_id
        life = Lifecycle(rid)
        self.lifecycles[rid] = life
        life.advance(State.ADMITTED)
        prefill = decode = None
        q: asyncio.Queue[GenerateDelta | ErrorInfo] | None = None
        prefill_task: asyncio.Task[P.Message] | None = None
        try:
            prefill, decode = self._pick(self.prefills, req), self._pick(self.decodes)
            prefill.inflight += 1
            decode.inflight += 1
            reservation = await self._reserve(decode, req)
            life.advance(State.RESERVED)
            q = decode.subscribe(rid)
            started = prefill.watch_handoff(rid)
            life.advance(State.PREFILLING)
            prefill_task = asyncio.ensure_future(prefill.call(
                lambda cid: P.PrefillReq(call_id=cid, request=req, reservation=reservation),
                self.handoff_timeout_s))
            first = True
            while True:
                item = await self._next(q, prefill_task, started, decode, first, req)
                if isinstance(item, ErrorInfo):
                    raise KvsealError.from_info(item)
                if first:
                    life.advance(State.TRANSFERRING)  # decode streams only after it verified the KV
                    life.advance(State.VERIFIED)
                    life.advance(State.DECODING)
                    first = False
                if item.final is not None and item.error is not None:
                    raise KvsealError.from_info(item.error)
                if item.final is not None:
                    life.finish(FinishReason(item.final))
                    cached = await self._prefill_settled(prefill_task, rid)
                    item = msgspec.structs.replace(item, cached_tokens=cached)  # prefill's cache, not decode's
                yield item
                if item.final is not None:
                    return
        except KvsealError as err:
            before_transfer = life.state in (State.ADMITTED, State.RESERVED, State.PREFILLING)
            if isinstance(err, RequestAborted):
                life.abort(err)
            elif before_transfer and (err.status < 500 or isinstance(err, Overloaded)):
                life.reject(err)
            else:
                life.fail(err)
            if decode is not None:
                await self._safe_notify(decode, P.ReleaseReq(request_id=rid, error=err.to_info(),
                                                              rejected=life.state is State.REJECTED))
            if prefill is not None:
                await self._safe_notify(prefill, P.AbortReq(request_id=rid, error=err.to_info()))
            yield _final_error(req, life, err)
        finally:
            if not life.terminal:  # the consumer went away (client disconnect): abort on both sides
                cause = RequestAborted("the client disconnected")
                life.abort(cause)
                for w in (decode, prefill):
                    if w is not None:
                        await self._safe_notify(w, P.AbortReq(request_id=rid, error=cause.to_info()))
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()
            if q is not None and decode is not None:
                decode.unsubscribe(rid)
            if prefill is not None:
                prefill.unsubscribe(rid)
            for w in (prefill, decode):
                if w is not None:
                    w.inflight -= 1
            self.lifecycles.pop(rid, None)
            self.ended[life.state.value] = self.ended.get(life.state.value, 0) + 1

    async def _reserve(self, decode: WorkerClient, req: GenerateRequest) -> Any:
        """Reserve decode pages; a full decode pool is waited out (bounded), then 503."""
        deadline = time.monotonic() + self.wait_timeout_s
        while True:
            resp = await decode.call(lambda cid: P.ReserveReq(call_id=cid, request=req), 30.0)
            assert isinstance(resp, P.ReserveResp)
            if resp.reservation is not None:
                return resp.reservation
            assert resp.error is not None
            err = KvsealError.from_info(resp.error)
            if not isinstance(err, Overloaded) or time.monotonic() > deadline:
                raise err
            await asyncio.sleep(0.05)

    async def _next(self, q: asyncio.Queue[GenerateDelta | ErrorInfo], prefill_task: asyncio.Task[P.Message],
                    started: asyncio.Event, decode: WorkerClient, first: bool,
                    req: GenerateRequest) -> GenerateDelta | ErrorInfo:
        """The next delta from decode. Before the first one, a prefill failure ends the request, and while
        the prompt is still queued or computing on prefill, decode's reservation is renewed: a busy prefill
        queue is not a transfer timeout. Once prefill reports the handoff started, decode's own reservation
        timeout bounds the transfer."""
        timeout = self.handoff_timeout_s if first else self.stall_timeout_s
        renew_every = min(self.renew_every_s, float(decode.info.get("reservation_timeout_s", 120.0)) / 4)
        deadline = time.monotonic() + timeout
        get = asyncio.ensure_future(q.get())
        done: set[asyncio.Future[Any]] = set()
        try:
            while not done and (left := deadline - time.monotonic()) > 0:
                waiting: set[asyncio.Future[Any]] = {get}
                if first and not prefill_task.done():
                    waiting.add(prefill_task)
                wait = min(left, renew_every) if first else left
                done, _ = await asyncio.wait(waiting, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if first and not done and not started.is_set():  # prefill still queued or computing
                    await self._safe_notify(decode, P.RenewReq(request_id=req.request_id))
        finally:
            if not get.done():
                get.cancel()
        if get in done:
            return get.result()
        if prefill_task in done:
            exc = prefill_task.exception()
            if exc is not None:
                return exc.to_info() if isinstance(exc, KvsealError) else WorkerFailed(str(exc)).to_info()
            resp = prefill_task.result()
            assert isinstance(resp, P.PrefillResp)
            if resp.error is not None:
                return resp.error
            # handed off: decode verified and acked, its first delta is on the way
            return await self._next(q, prefill_task, started, decode, first, req)
        if first:
            return TransferTimeout(f"no verified KV handoff for {req.request_id} within "
                                   f"{self.handoff_timeout_s:g}s").to_info()
        return WorkerFailed(f"{decode.name} produced nothing for {self.stall_timeout_s:g}s").to_info()

    async def _prefill_settled(self, task: asyncio.Task[P.Message], rid: str) -> int:
        """Decode is done; hold the last delta until prefill reported the handoff ended (its pages scrubbed
        and freed), so a client that sees its response end sees every worker back at baseline (seal 8).
        Bounded: prefill's answer follows decode's ack within milliseconds; a lost answer only logs.
        Returns the prompt tokens prefill served from its prefix cache (0 when unknown)."""
        try:
            resp = await asyncio.wait_for(asyncio.shield(task), timeout=10.0)
        except Exception as exc:  # noqa: BLE001 - the output is complete and verified either way
            log.warning("request %s: no handoff answer from prefill after decode finished: %r", rid, exc)
            return 0
        return resp.cached_tokens if isinstance(resp, P.PrefillResp) else 0

    async def _safe_notify(self, w: WorkerClient, msg: P.Message) -> None:
        try:
            await w.notify(msg)
        except Exception as exc:  # noqa: BLE001 - a dead peer frees its pages by its own timeouts
            log.warning("could not notify %s: %s", w.name, exc)


def _final_error(req: GenerateRequest, life: Lifecycle, err: KvsealError) -> GenerateDelta:
    return GenerateDelta(req.request_id, [], "", final=life.state.value, error=err.to_info(),
                         prompt_tokens=len(req.prompt_ids))

"""The router's handle on one worker: a ZeroMQ DEALER, calls with timeouts, per-request delta queues,
and a heartbeat that declares the worker dead (failing its requests) when it stops answering."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvseal.engine.messages import GenerateDelta
from kvseal.errors import ErrorInfo, WorkerFailed
from kvseal.worker import protocol as P

log = logging.getLogger("kvseal.router")


class WorkerClient:
    def __init__(self, role: str, endpoint: str, ctx: zmq.asyncio.Context, heartbeat_s: float = 1.0,
                 dead_after_s: float = 60.0) -> None:
        self.role, self.endpoint = role, endpoint
        self.sock: zmq.asyncio.Socket = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.heartbeat_s, self.dead_after_s = heartbeat_s, dead_after_s
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[P.Message]] = {}
        self._streams: dict[str, asyncio.Queue[GenerateDelta | ErrorInfo]] = {}
        self._handoffs: dict[str, asyncio.Event] = {}  # request id -> set when prefill starts its handoff
        self._tasks: list[asyncio.Task[None]] = []
        self.last_seen = time.monotonic()
        self.alive = True
        self.info: dict[str, Any] = {}
        self.inflight = 0  # requests routed here and not yet ended: the load used for pairing

    @property
    def name(self) -> str:
        return f"{self.role} worker {self.endpoint}"

    def start(self) -> None:
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._tasks = [asyncio.ensure_future(self._reader()), asyncio.ensure_future(self._heartbeat()),
                       asyncio.ensure_future(self._watch())]

    async def _watch(self) -> None:
        """A dropped TCP connection means the worker process died (or its host went away): fail its
        requests at once instead of waiting for the heartbeat. A reconnect puts it back in rotation."""
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                if self.alive:
                    log.error("%s disconnected; failing its requests", self.name)
                self.alive = False
                self._fail_all(WorkerFailed(f"{self.name} disconnected (the worker died or its host is gone)"))
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self.alive:
                try:
                    await self.fetch_info(timeout=10.0)
                    self.alive = True
                    log.warning("%s reconnected; back in rotation", self.name)
                except WorkerFailed:
                    pass

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._tasks:
            self.sock.disable_monitor()
            self._monitor.close(0)
        self.sock.close(0)

    async def call(self, make: Any, timeout: float) -> P.Message:
        """Send make(call_id) and await the answer with the same call_id."""
        cid = next(self._ids)
        fut: asyncio.Future[P.Message] = asyncio.get_running_loop().create_future()
        self._calls[cid] = fut
        try:
            await self.sock.send(P.encode(make(cid)))
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise WorkerFailed(f"{self.name} did not answer within {timeout:g}s") from None
        finally:
            self._calls.pop(cid, None)

    async def notify(self, msg: P.Message) -> None:
        await self.sock.send(P.encode(msg))

    def subscribe(self, request_id: str) -> asyncio.Queue[GenerateDelta | ErrorInfo]:
        q: asyncio.Queue[GenerateDelta | ErrorInfo] = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def unsubscribe(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._handoffs.pop(request_id, None)

    def watch_handoff(self, request_id: str) -> asyncio.Event:
        """Set when this (prefill) worker reports that the request's KV handoff started."""
        ev = self._handoffs[request_id] = asyncio.Event()
        return ev

    async def fetch_info(self, timeout: float = 5.0) -> dict[str, Any]:
        resp = await self.call(lambda cid: P.InfoReq(call_id=cid), timeout)
        assert isinstance(resp, P.InfoResp)
        self.info = resp.info
        return resp.info

    async def _reader(self) -> None:
        while True:
            data = await self.sock.recv()
            self.last_seen = time.monotonic()
            try:
                msg = P.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("%s sent a malformed message: %s", self.name, exc)
                continue
            if isinstance(msg, P.HandoffStarted):
                ev = self._handoffs.get(msg.request_id)
                if ev is not None:
                    ev.set()
                continue
            if isinstance(msg, P.DeltaMsg):
                q = self._streams.get(msg.delta.request_id)
                if q is not None:
                    q.put_nowait(msg.delta)
                continue
            fut = self._calls.get(getattr(msg, "call_id", -1))
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self.fetch_info(timeout=self.dead_after_s)
                if not self.alive:
                    log.warning("%s answers again; back in rotation", self.name)
                self.alive = True
            except WorkerFailed:
                if self.alive:
                    log.error("%s stopped answering; failing its requests", self.name)
                self.alive = False
                self._fail_all(WorkerFailed(f"{self.name} stopped answering (dead or unreachable)"))

    def _fail_all(self, err: WorkerFailed) -> None:
        info = err.to_info()
        for q in self._streams.values():
            q.put_nowait(info)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(WorkerFailed(err.message))

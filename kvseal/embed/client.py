"""The router's handle on its embed worker: a ZeroMQ DEALER (with fleet keys, a CURVE client pinned to the
worker's key), calls by id, and a heartbeat.

At start the worker's card must match the folder the router tokenizes with (model, dimensions, longest input):
a router never serves embeddings it did not check. A call waits for its answer while the worker answers the
heartbeat; a worker silent for `dead_after_s` fails every call in flight (502) and new calls are refused (503)
until it answers again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from kvseal.auth.curve import as_client
from kvseal.auth.keys import MemberKeys
from kvseal.embed import wire
from kvseal.embed.folder import EmbedFolder
from kvseal.errors import KvsealError, NoWorkerAvailable, WorkerFailed

log = logging.getLogger("kvseal.embed")


class EmbedClient:
    def __init__(self, endpoint: str, folder: EmbedFolder, name: str | None = None, keys: MemberKeys | None = None,
                 server_key: str | None = None, heartbeat_s: float = 1.0, dead_after_s: float = 30.0) -> None:
        self.endpoint, self.folder = endpoint, folder  # folder: the model as the router tokenizes for it
        self.name = name or folder.name  # the model id in the API
        self.dim, self.pipeline, self.vocab_size = folder.dim, folder.pipeline, folder.arch.vocab_size
        self.keys, self.server_key = keys, server_key
        self.heartbeat_s, self.dead_after_s = heartbeat_s, dead_after_s
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[wire.Message]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.sock: zmq.asyncio.Socket | None = None
        self.last_seen = 0.0
        self.last_card: wire.Card | None = None
        self.gone: Callable[[], bool] = lambda: False  # the worker process ended (set by whoever started it)

    @property
    def alive(self) -> bool:
        return time.monotonic() - self.last_seen < self.dead_after_s

    async def start(self, timeout_s: float = 600.0) -> None:
        """Connect, and wait for the worker's card (it loads its model meanwhile); ValueError when it differs."""
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        as_client(self.sock, self.keys, self.server_key, f"embed worker at {self.endpoint}")
        self.sock.connect(self.endpoint)
        self._tasks.append(asyncio.ensure_future(self._reader()))
        card = await self._hello(timeout_s)
        p = self.pipeline
        want = (self.dim, p.max_tokens, p.pooling, p.normalize)
        got = (card.dim, card.max_tokens, card.pooling, card.normalize)
        if got != want:
            raise ValueError(f"the embed worker at {self.endpoint} serves {card.model} with (dimensions, longest "
                             f"input, pooling, normalize) {got}, and the router tokenizes for {want}: start both "
                             f"from the same --embed-model folder")
        self._tasks.append(asyncio.ensure_future(self._heartbeat()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for f in self._calls.values():
            if not f.done():
                f.cancel()
        if self.sock is not None:
            self.sock.close(0)
            self.ctx.term()

    async def _hello(self, timeout_s: float) -> wire.Card:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                card = await self._call(lambda cid: wire.Hello(call_id=cid), 5.0)
            except TimeoutError:
                if self.gone():
                    raise ValueError(f"the embed worker for {self.folder.folder} exited before it answered; see "
                                     f"its log above") from None
                if time.monotonic() > deadline:
                    raise ValueError(f"the embed worker at {self.endpoint} did not answer within {timeout_s:g}s; "
                                     f"see its log") from None
                continue
            assert isinstance(card, wire.Card)
            self.last_card = card
            return card

    async def _call(self, make: Any, timeout_s: float | None) -> wire.Message:
        assert self.sock is not None
        cid = next(self._ids)
        fut: asyncio.Future[wire.Message] = asyncio.get_running_loop().create_future()
        self._calls[cid] = fut
        try:
            await self.sock.send(wire.encode(make(cid)))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._calls.pop(cid, None)

    async def _reader(self) -> None:
        assert self.sock is not None
        while True:
            data = await self.sock.recv()
            try:
                msg = wire.decode(data)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                log.warning("dropped a frame from the embed worker that does not decode: %s", exc)
                continue
            self.last_seen = time.monotonic()
            fut = self._calls.get(getattr(msg, "call_id", -1))
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if self.gone():  # the process ended: its calls fail now, not after dead_after_s
                self.last_seen = 0.0
                self._fail(WorkerFailed("the embed worker exited"))
                continue
            try:
                card = await self._call(lambda cid: wire.Hello(call_id=cid), self.dead_after_s)
                assert isinstance(card, wire.Card)
                self.last_card = card
            except TimeoutError:
                log.error("the embed worker at %s did not answer for %.0f s: failing its calls",
                          self.endpoint, self.dead_after_s)
                self._fail(WorkerFailed(f"the embed worker stopped answering for {self.dead_after_s:g}s"))

    def _fail(self, err: WorkerFailed) -> None:
        for f in list(self._calls.values()):
            if not f.done():
                f.set_exception(err)

    async def embed(self, tenant: str, weight: float, ids: list[list[int]]) -> np.ndarray:
        """(inputs, dim) float32 rows; KvsealError as the worker refused or failed. Cancelled (the client left):
        the worker drops what of the call is still queued."""
        if not self.alive:
            raise NoWorkerAvailable("the embed worker is not answering; try again later")
        assert self.sock is not None
        cid = next(self._ids)
        fut: asyncio.Future[wire.Message] = asyncio.get_running_loop().create_future()
        self._calls[cid] = fut
        try:
            await self.sock.send(wire.encode(wire.EmbedReq(call_id=cid, tenant=tenant, weight=weight, ids=ids)))
            resp = await fut
        except asyncio.CancelledError:
            await self.sock.send(wire.encode(wire.Abort(call_id=cid)))
            raise
        finally:
            self._calls.pop(cid, None)
        assert isinstance(resp, wire.EmbedResp)
        if resp.error is not None:
            raise KvsealError.from_info(resp.error)
        rows = np.frombuffer(resp.data, dtype="<f4")
        if rows.size != len(ids) * self.dim:
            raise WorkerFailed(f"the embed worker answered {rows.size} values for {len(ids)} inputs of "
                               f"{self.dim} dimensions")
        return rows.reshape(len(ids), self.dim)

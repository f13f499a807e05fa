"""The unified worker: one in-process engine behind the Backend interface (both phases, one process)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from kvseal.engine.engine import Engine
from kvseal.engine.loop import EngineLoop
from kvseal.errors import RequestAborted
from kvseal.wire.messages import GenerateDelta, GenerateRequest


class UnifiedBackend:
    def __init__(self, engine: Engine, model_name: str | None = None, chat_template: str | None = None,
                 threads: int | None = None) -> None:
        self.engine = engine
        self.model_name = model_name or engine.ckpt_name
        # the API renders chats with this tokenizer; --chat-template replaces the model's own template
        self.tokenizer = engine.tokenizer if chat_template is None else engine.tokenizer.with_chat_template(
            chat_template)
        self.context_window = engine.context_window
        self._loop = EngineLoop(engine, self._on_output, threads)  # threads: the engine loop's (EngineLoop)
        self._queues: dict[str, asyncio.Queue[GenerateDelta]] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._aloop = asyncio.get_running_loop()
        self._loop.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self._loop.stop)

    def _on_output(self, deltas: list[GenerateDelta]) -> None:  # on the engine thread
        assert self._aloop is not None
        self._aloop.call_soon_threadsafe(self._deliver, deltas)

    def _deliver(self, deltas: list[GenerateDelta]) -> None:
        for d in deltas:
            q = self._queues.get(d.request_id)
            if q is not None:
                q.put_nowait(d)

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        q: asyncio.Queue[GenerateDelta] = asyncio.Queue()
        self._queues[req.request_id] = q
        done = False
        try:
            self._loop.submit(req)
            while not done:
                d = await q.get()
                done = d.final is not None
                yield d
        finally:
            self._queues.pop(req.request_id, None)
            if not done:  # the consumer went away (client disconnect): free the pages now
                self._loop.abort(req.request_id, RequestAborted("the client disconnected"))

    async def info(self) -> dict[str, Any]:
        snap = await asyncio.wrap_future(self._loop.call(lambda e: e.info()))
        return {**snap, "served_model_name": self.model_name}

    async def healthy(self) -> bool:
        return self._loop.is_alive()

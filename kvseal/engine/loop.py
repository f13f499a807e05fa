"""Runs an Engine on its own thread; other threads reach it only through a queue.

The engine itself stays single-threaded: submit/abort/call only enqueue commands that the loop thread
applies between steps. Outputs go to `on_output`, called on the loop thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvseal.engine.engine import Engine
from kvseal.errors import InternalError, KvsealError
from kvseal.wire.messages import GenerateDelta, GenerateRequest

log = logging.getLogger("kvseal.engine")


class EngineLoop:
    def __init__(self, engine: Engine, on_output: Callable[[list[GenerateDelta]], None],
                 threads: int | None = None) -> None:
        self.engine = engine
        self.threads = threads  # torch's thread count for the loop thread (None: what torch has)
        self._on_output = on_output
        self._inbox: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvseal-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(lambda: None)
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, req: GenerateRequest) -> None:
        self._inbox.put(lambda: self.engine.add_request(req))

    def abort(self, request_id: str, cause: KvsealError | None = None) -> None:
        self._inbox.put(lambda: self.engine.abort(request_id, cause))

    def call(self, fn: Callable[[Engine], Any]) -> Future[Any]:
        """Run fn(engine) on the loop thread between steps (e.g. a consistent /info snapshot)."""
        fut: Future[Any] = Future()

        def run() -> None:
            try:
                fut.set_result(fn(self.engine))
            except BaseException as exc:  # noqa: BLE001 - delivered to the caller
                fut.set_exception(exc)

        self._inbox.put(run)
        return fut

    def _run(self) -> None:
        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)
        if self.engine.kernels == "native":
            from kvseal.kernels.ops import match_torch_threads

            match_torch_threads()
        while not self._stop.is_set():
            busy = self.engine.has_work()
            try:
                cmd = self._inbox.get(block=not busy, timeout=None if busy else 0.5)
                cmd()
                while True:
                    self._inbox.get_nowait()()
            except queue.Empty:
                pass
            if self._stop.is_set() or not self.engine.has_work():
                continue
            try:
                out = self.engine.step()
            except Exception:  # noqa: BLE001 - any engine fault fails its requests, never the loop
                log.error("engine step failed; failing its requests:\n%s", traceback.format_exc())
                self.engine.fail_all(InternalError("the engine failed while running this request"))
                out = self.engine.take_output()
            if out:
                self._on_output(out)

"""The n samples of one request, as one stream of (sample index, delta).

Sample 0 starts at once; the others start when its first delta arrives: its prompt's full pages are in the
prefix cache by then (the engine caches them in the step that completes the prompt), so the other samples read
them instead of computing the prompt again (seal 9 holds: same tenant, same cache_salt). Each sample is its own
request to the backend, with its own id and seed stream (wire/seeds.sample_seed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable

from kvseal.errors import InternalError, KvsealError
from kvseal.wire.messages import GenerateDelta

log = logging.getLogger("kvseal.router")
Deltas = AsyncGenerator[GenerateDelta, None]


class Fanout:
    def __init__(self, start: Callable[[int], Deltas], n: int) -> None:
        self._start, self.n = start, n
        # (index, delta); None: that sample's backend stopped without a final delta
        self._queue: asyncio.Queue[tuple[int, GenerateDelta | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._launch(0)

    def _launch(self, i: int) -> None:
        self._tasks.append(asyncio.ensure_future(self._pump(i, self._start(i))))

    async def _pump(self, i: int, gen: Deltas) -> None:
        try:
            async for d in gen:
                if i == 0 and len(self._tasks) == 1 and d.error is None:  # a refused sample 0 ends them all
                    for j in range(1, self.n):
                        self._launch(j)
                self._queue.put_nowait((i, d))
                if d.final is not None:
                    return
            self._queue.put_nowait((i, None))
        except KvsealError as err:  # a backend that raises instead of ending the request: the same outcome
            self._failed(i, err)
        except Exception:  # whatever else it raises ends the sample too: the client never waits forever
            log.exception("sample %d of a request raised", i)
            self._failed(i, InternalError("the router failed while running this request; it was not completed"))
        finally:
            await gen.aclose()  # a sample not finished is aborted on every worker it reached

    def _failed(self, i: int, err: KvsealError) -> None:
        self._queue.put_nowait((i, GenerateDelta("", [], "", final="failed", error=err.to_info())))

    async def next(self) -> tuple[int, GenerateDelta | None]:
        return await self._queue.get()

    async def aclose(self) -> None:
        """Abort every sample still running (a finished one is left as it is)."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

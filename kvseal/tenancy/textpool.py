"""Threads for rendering chat templates and tokenizing, shared by the tenants through a fair queue (seal 11).

asyncio's default executor is one pool for everything, first come first served: a tenant that sends a few huge
prompts fills it and every other tenant's prompt waits behind them (measured: 37.6 s for a 1-token chat). Here the
work has its own `threads`, no tenant runs more than `per_tenant` jobs at once (on two threads, one: the other
is always free for someone else), and each tenant has its own queue. A thread that frees up takes the oldest job of
the next tenant in turn, round robin, that has one and is under its cap. A job whose caller went away before it
started never runs; one already running cannot be stopped, and it keeps its tenant's place until it ends. The
threads run at a lower CPU priority than the rest of the process (as the grammar compilers do): a huge prompt being
tokenized yields the cores to the engine's steps, which serve every tenant.

Invariants: running[t] <= per_tenant for every tenant t; sum of running == self.busy <= threads; a job waits only
while every thread is busy or its own tenant is at its cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    result: asyncio.Future[Any]  # cancelled when the caller went away


class TextPool:
    def __init__(self, threads: int, per_tenant: int) -> None:
        if not 1 <= per_tenant <= threads:
            raise ValueError(f"TextPool per_tenant={per_tenant} must be in [1, threads={threads}]")
        self.threads, self.per_tenant = threads, per_tenant
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvseal-text", initializer=_lower_priority)
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()  # tenant -> its waiting jobs, in turn order
        self.running: dict[str, int] = {}  # tenant -> its jobs on a thread now (absent: none)
        self.busy = 0

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on one of the pool's threads, when the tenant's turn comes."""
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop.create_future())
        self._queues.setdefault(tenant, deque()).append(job)
        self._start(loop)
        result: T = await job.result  # a cancelled caller cancels job.result: queued, it is skipped
        return result

    def waiting(self, tenant: str) -> int:
        return sum(not j.result.done() for j in self._queues.get(tenant, ()))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        while self.busy < self.threads:
            nxt = self._next()
            if nxt is None:
                return
            tenant, job = nxt
            self.running[tenant] = self.running.get(tenant, 0) + 1
            self.busy += 1
            self._pool.submit(job.fn, *job.args).add_done_callback(self._on_done(loop, tenant, job))

    def _next(self) -> tuple[str, _Job] | None:
        """The oldest live job of the first tenant in turn that is under its cap; that tenant goes to the back."""
        for tenant in list(self._queues):
            q = self._queues[tenant]
            while q and q[0].result.done():  # its caller went away
                q.popleft()
            if not q:
                del self._queues[tenant]
                continue
            if self.running.get(tenant, 0) >= self.per_tenant:
                continue
            job = q.popleft()
            if q:
                self._queues.move_to_end(tenant)
            else:
                del self._queues[tenant]
            return tenant, job
        return None

    def _on_done(self, loop: asyncio.AbstractEventLoop, tenant: str, job: _Job) -> Callable[[Future[Any]], None]:
        def done(f: Future[Any]) -> None:  # on the pool's thread: the rest happens on the loop
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._finish, loop, tenant, job, f)
        return done

    def _finish(self, loop: asyncio.AbstractEventLoop, tenant: str, job: _Job, done: Future[Any]) -> None:
        self.busy -= 1
        self.running[tenant] -= 1
        if not self.running[tenant]:
            del self.running[tenant]
        if done.cancelled():  # the pool shut down
            job.result.cancel()
        elif not job.result.done():
            exc = done.exception()
            if exc is not None:
                job.result.set_exception(exc)
            else:
                job.result.set_result(done.result())
        self._start(loop)


NICE = 10


def _lower_priority() -> None:
    """On Linux a thread has its own nice value: this pool thread's, raised (a lower priority)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)

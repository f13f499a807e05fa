"""A small pool of grammar compiler processes (engine/grammar_compiler.py), driven from the engine's loop thread.

Nothing here blocks the loop: submit() queues a job; poll() moves bytes through non-blocking pipes, gives waiting
jobs to idle processes, kills a process whose compile ran past the time limit (its job ends with a 400 naming
response_format) and returns the jobs that ended. Processes start on demand, up to `size` (a killed or dead one is
replaced when a job needs it), and sit idle between jobs. A free process takes the waiting job of the tenant with the
fewest compiles running, then the one served longest ago, then in arrival order: tenants take turns, so one tenant's
queue of slow schemas delays another tenant's compile by at most one of them per process.

Invariant: a job is in exactly one place: queued, on one process (`_Child.job`), or returned once by poll().
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field

import msgspec

from kvseal.engine.grammar_compiler import CompileJob, CompileResult, CompilerInit, frame
from kvseal.errors import InternalError, InvalidRequest, KvsealError

Compiled = str | KvsealError  # a CompiledGrammar's serialized JSON, or why the format cannot be enforced
_HEAD = 4


@dataclass
class _Job:
    tenant: str
    job: CompileJob


@dataclass
class _Child:
    proc: subprocess.Popen[bytes]
    outbuf: bytearray  # bytes still to write to its stdin
    inbuf: bytearray = field(default_factory=bytearray)  # bytes read from its stdout, not yet a whole frame
    ready: bool = False  # it answered CompileResult(0): jobs may go to it
    job: _Job | None = None
    since: float = field(default_factory=time.monotonic)  # when it started, or when its job did


def _kill_all(children: list[_Child], reaping: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL each (xgrammar cannot be interrupted) and leave it to be reaped: waiting here would hold the loop
    while the kernel tears down a process that imported torch (tens of ms)."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.kill()
        for pipe in (c.proc.stdin, c.proc.stdout):
            if pipe is not None:
                pipe.close()
        reaping.append(c.proc)
    children.clear()


def _reap(reaping: list[subprocess.Popen[bytes]], block: bool = False) -> None:
    for p in list(reaping):
        if block:
            p.wait()
        if p.poll() is not None:
            reaping.remove(p)


def _close(children: list[_Child], reaping: list[subprocess.Popen[bytes]]) -> None:
    _kill_all(children, reaping)
    _reap(reaping, block=True)


class GrammarPool:
    def __init__(self, init: CompilerInit, size: int, timeout_s: float, start_timeout_s: float = 120.0) -> None:
        self.size, self.timeout_s, self.start_timeout_s = size, timeout_s, start_timeout_s
        self._init = frame(init)
        self._children: list[_Child] = []
        self._reaping: list[subprocess.Popen[bytes]] = []  # killed, not yet reaped
        self._queue: list[_Job] = []
        self._done: list[tuple[int, Compiled]] = []
        self._served: dict[str, int] = {}  # tenant -> the number of its last job given to a process
        self._dispatched = 0
        self.started = 0  # processes started
        self.killed = 0  # processes killed at the time limit
        weakref.finalize(self, _close, self._children, self._reaping)  # no compiler outlives its pool

    @property
    def busy(self) -> bool:
        """A job is waiting or compiling: poll() has work to do."""
        return bool(self._queue) or any(c.job is not None for c in self._children)

    @property
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self._children]

    def submit(self, tenant: str, job: CompileJob) -> None:
        self._queue.append(_Job(tenant, job))

    def poll(self, wait: float = 0.0) -> list[tuple[int, Compiled]]:
        """Advance every job; return (job id, outcome) for each that ended. Waits up to `wait` seconds for a
        process to answer (only while one is compiling or starting; never past a time limit)."""
        self._dispatch()
        self._io(wait)
        self._enforce_limits()
        self._dispatch()
        _reap(self._reaping)
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        _close(self._children, self._reaping)
        for j in self._queue:
            self._done.append((j.job.job_id, InternalError("the grammar compilers were shut down")))
        self._queue.clear()

    # -- jobs to processes ------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        for c in self._children:
            if self._queue and c.ready and c.job is None:
                running: dict[str, int] = {}
                for other in self._children:
                    if other.job is not None:
                        running[other.job.tenant] = running.get(other.job.tenant, 0) + 1
                j = min(self._queue, key=lambda q: (running.get(q.tenant, 0), self._served.get(q.tenant, -1)))
                self._queue.remove(j)  # min() keeps the first of a tie: arrival order
                self._served[j.tenant] = self._dispatched
                self._dispatched += 1
                c.job, c.since = j, time.monotonic()
                c.outbuf += frame(j.job)
        starting = sum(not c.ready for c in self._children)
        while len(self._children) < self.size and starting < len(self._queue):
            self._start()
            starting += 1

    def _start(self) -> None:
        proc = subprocess.Popen([sys.executable, "-m", "kvseal.engine.grammar_compiler"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, close_fds=True)
        assert proc.stdin is not None and proc.stdout is not None
        os.set_blocking(proc.stdin.fileno(), False)
        os.set_blocking(proc.stdout.fileno(), False)
        self._children.append(_Child(proc, bytearray(self._init)))
        self.started += 1

    # -- bytes ------------------------------------------------------------------------------------------
    def _io(self, wait: float) -> None:
        waiting = [c for c in self._children if c.job is not None or not c.ready]
        if waiting and wait > 0:  # never past the nearest time limit
            now = time.monotonic()
            wait = max(0.0, min(wait, *(c.since + self._limit(c) - now for c in waiting)))
        else:
            wait = 0.0
        readers = {c.proc.stdout.fileno(): c for c in self._children if c.proc.stdout is not None}
        writers = {c.proc.stdin.fileno(): c for c in self._children if c.outbuf and c.proc.stdin is not None}
        if not readers:
            return
        readable, writable, _ = select.select(list(readers), list(writers), [], wait)
        for fd in writable:
            c = writers[fd]
            try:
                while c.outbuf:
                    del c.outbuf[: os.write(fd, c.outbuf)]
            except BlockingIOError:
                pass
            except OSError:  # its stdin closed: it died; _enforce_limits reaps it
                c.outbuf.clear()
        for fd in readable:
            self._read(readers[fd])

    def _read(self, c: _Child) -> None:
        try:
            while chunk := os.read(c.proc.stdout.fileno(), 1 << 16):  # type: ignore[union-attr]
                c.inbuf += chunk
        except BlockingIOError:
            pass
        while len(c.inbuf) >= _HEAD:
            n = int.from_bytes(c.inbuf[:_HEAD], "big")
            if len(c.inbuf) < _HEAD + n:
                break
            body = bytes(c.inbuf[_HEAD : _HEAD + n])
            del c.inbuf[: _HEAD + n]
            try:
                res = msgspec.msgpack.decode(body, type=CompileResult)
            except msgspec.DecodeError:
                self._kill(c, InternalError("the grammar compiler sent a malformed answer"))
                return
            self._on_result(c, res)

    def _on_result(self, c: _Child, res: CompileResult) -> None:
        if res.job_id == 0:
            c.ready, c.since = True, time.monotonic()
            return
        if c.job is None or c.job.job.job_id != res.job_id:
            self._kill(c, InternalError("the grammar compiler answered a job it was not given"))
            return
        outcome: Compiled
        if res.grammar is not None:
            outcome = res.grammar
        else:
            outcome = InvalidRequest(f"response_format.json_schema.schema is not a JSON schema kvseal can enforce: "
                                     f"{res.error}", param="response_format.json_schema.schema")
        self._done.append((res.job_id, outcome))
        c.job = None

    # -- time limits and deaths -------------------------------------------------------------------------
    def _limit(self, c: _Child) -> float:
        return self.timeout_s if c.ready else self.start_timeout_s

    def _enforce_limits(self) -> None:
        now = time.monotonic()
        for c in list(self._children):
            if c.proc.poll() is not None:
                self._read(c)  # an answer it wrote before it ended still counts
                if c in self._children:
                    self._kill(c, InvalidRequest("the grammar compiler ended while compiling this response_format; "
                                                 "simplify the schema", param="response_format"))
            elif (c.job is not None or not c.ready) and now - c.since > self._limit(c):
                self._kill(c, InvalidRequest(
                    f"response_format took longer than {self.timeout_s:g}s to compile (the server's "
                    f"--grammar-timeout); simplify the schema (long repetitions such as a pattern [0-9]{{8000}}, "
                    f"or deep nesting, compile slowly)", param="response_format"))
                self.killed += 1

    def _kill(self, c: _Child, why: KvsealError) -> None:
        """End one process (SIGKILL: xgrammar cannot be interrupted) and its job with `why`. One that dies before
        it was ready ends the waiting jobs too: a compiler that cannot start is not retried in a loop."""
        self._children.remove(c)
        _kill_all([c], self._reaping)
        if c.job is not None:
            self._done.append((c.job.job.job_id, why))
        elif not c.ready:
            failed = InternalError("the grammar compiler process did not start; see the worker's log")
            self._done += [(j.job.job_id, failed) for j in self._queue]
            self._queue.clear()

"""`kvseal serve`'s fleet: prefill and decode worker processes on loopback, stopped with the router."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from types import TracebackType
from typing import Self

# each worker started here gets this process's pid in its environment and stops when this process is gone
LAUNCHER_PID_ENV = "KVSEAL_LAUNCHER_PID"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Fleet:
    def __init__(self, prefill_argv: list[str], decode_argv: list[str], num_prefill: int, num_decode: int) -> None:
        if num_prefill < 1 or num_decode < 1:
            raise ValueError(f"invalid --prefill {num_prefill} / --decode {num_decode}: give at least 1 of each")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.prefill_endpoints: list[str] = []
        self.decode_endpoints: list[str] = []
        for role, n, eps, engine_argv in (("prefill", num_prefill, self.prefill_endpoints, prefill_argv),
                                          ("decode", num_decode, self.decode_endpoints, decode_argv)):
            for _ in range(n):
                port = _free_port()
                eps.append(f"tcp://127.0.0.1:{port}")
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "kvseal", role, *engine_argv, "--port", str(port)],
                    env={**os.environ, LAUNCHER_PID_ENV: str(os.getpid())}))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def stop(self, timeout: float = 10.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()

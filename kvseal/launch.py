"""`kvseal serve`'s fleet: prefill and decode worker processes on loopback, stopped with the router.

With fleet keys (the default), each worker gets a fresh keypair made here, in memory, and an allow-list of the
router's and its fellow workers' public keys, in its WorkerSpec on stdin (never argv or the environment); the
router pins each worker's key (`server_keys`) and allow-lists them all (`router_keys`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
from types import TracebackType
from typing import TYPE_CHECKING, Self

import msgspec

from kvseal.auth.keys import MemberKeys, fresh_member
from kvseal.wire import protocol as P
from kvseal.worker.cores import LendSpec, new_table

if TYPE_CHECKING:
    from kvseal.worker.run import WorkerSpec

# each worker started here gets this process's pid in its environment and stops when this process is gone


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Fleet:
    """Each worker is `python -m kvseal.worker.run` with its WorkerSpec (JSON) on stdin, on a loopback port."""

    def __init__(self, prefill: WorkerSpec, decode: WorkerSpec, num_prefill: int, num_decode: int,
                 router_keys: MemberKeys | None = None, lend_cores: int | None = None) -> None:
        """lend_cores: this host's cores, for the workers to lend each other the home shares of those with no work
        (worker/cores.py); None: each steps on its own threads only."""
        if num_prefill < 1 or num_decode < 1:
            raise ValueError(f"invalid --prefill {num_prefill} / --decode {num_decode}: give at least 1 of each")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.prefill_endpoints: list[str] = []
        self.decode_endpoints: list[str] = []
        self.server_keys: dict[str, str] = {}  # worker control endpoint -> its public key
        self.router_keys = router_keys
        members = [fresh_member() for _ in range(num_prefill + num_decode)] if router_keys is not None else []
        if router_keys is not None:
            fleet = (router_keys.public, *(m.public for m in members))
            self.router_keys = router_keys.with_allowed(fleet)
            # the router's folder allow-list (serve --fleet-keys DIR), if any, admits workers that join later
            members = [msgspec.structs.replace(m, allowed_dir=router_keys.allowed_dir).with_allowed(fleet)
                       for m in members]
        homes = (*[prefill.worker.threads or lend_cores or 1] * num_prefill,
                 *[decode.worker.threads or lend_cores or 1] * num_decode)
        table = new_table(len(homes)) if lend_cores is not None else None
        slots = iter(range(len(homes)))
        for spec, n, eps in ((prefill, num_prefill, self.prefill_endpoints),
                             (decode, num_decode, self.decode_endpoints)):
            for _ in range(n):
                port = _free_port()
                eps.append(f"tcp://127.0.0.1:{port}")
                mine = msgspec.structs.replace(spec, worker=dataclasses.replace(spec.worker, port=port))
                if members:
                    mine = msgspec.structs.replace(mine, keys=members.pop())
                    assert mine.keys is not None
                    self.server_keys[eps[-1]] = mine.keys.public
                slot = next(slots)
                if table is not None and lend_cores is not None:
                    mine = msgspec.structs.replace(mine, lend=LendSpec(
                        path=f"/proc/self/fd/{table}", slot=slot, homes=homes, cores=lend_cores))
                proc = subprocess.Popen([sys.executable, "-m", "kvseal.worker.run"], stdin=subprocess.PIPE,
                                        env={**os.environ, P.LAUNCHER_PID_ENV: str(os.getpid())},
                                        pass_fds=() if table is None else (table,))
                self.procs.append(proc)
                assert proc.stdin is not None
                proc.stdin.write(msgspec.json.encode(mine))
                proc.stdin.close()
        if table is not None:
            os.close(table)  # each worker holds it now (its own copy of the descriptor, opened again as its own)

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

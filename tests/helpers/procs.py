"""Start real kvseal processes on loopback for integration and end-to-end tests."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO

import httpx

from kvseal.wire.protocol import LAUNCHER_PID_ENV

# How long a started process may take to be ready. scripts/prove_seals.py shortens it: a mutation that keeps a
# fleet from ever forming (a worker that stops speaking CURVE) is caught at this timeout, not 3 minutes later.
READY_TIMEOUT = float(os.environ.get("KVSEAL_TEST_READY_TIMEOUT", "180"))


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range: a socket that binds port 0 meanwhile (another
    test's worker metrics server, a client) is never given it before the server this is for binds it (once a
    worker's metrics server took a test server's port and answered its /health)."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that range is full: any free port
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A kvseal subprocess whose output goes to a temp file (shown when a wait fails)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.log: IO[bytes] = tempfile.NamedTemporaryFile(prefix="kvseal-", suffix=".log", delete=False)  # noqa: SIM115
        # a worker stops when the test process is gone (a killed or timed-out test leaves no worker spinning)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", LAUNCHER_PID_ENV: str(os.getpid()), **(env or {})}
        self.p = subprocess.Popen([sys.executable, "-m", "kvseal", *args], stdout=self.log,
                                  stderr=subprocess.STDOUT, env=full_env, start_new_session=True)

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, "rb") as f:
            return f.read().decode(errors="replace")

    def wait_http(self, url: str, timeout: float | None = None) -> None:
        timeout = READY_TIMEOUT if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"process exited with {self.p.returncode}:\n{self.output()[-4000:]}")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{url} not ready after {timeout}s:\n{self.output()[-4000:]}")

    def wait_exit(self, timeout: float = 60.0) -> int:
        return self.p.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(10)
        return self.p.returncode


class Server(Proc):
    def __init__(self, extra: list[str] | None = None, env: dict[str, str] | None = None,
                 command: str = "serve") -> None:
        self.port = free_port()
        super().__init__([command, "--port", str(self.port), *(extra or [])], env)
        self.url = f"http://127.0.0.1:{self.port}"

    def ready(self, timeout: float | None = None) -> Server:
        self.wait_http(self.url + "/health", timeout)
        return self


class Worker(Proc):
    """`kvseal prefill|decode` on a free loopback port."""

    def __init__(self, role: str, extra: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.role, self.port = role, free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        # a worker started with --fleet-keys answers only a member: call() then uses these (kvseal.auth.keys)
        self.client_keys: object | None = None  # MemberKeys of the member the test speaks as
        self.server_key: str | None = None  # this worker's public key, pinned
        super().__init__([role, "--port", str(self.port), "--log-level", "info", *(extra or [])], env)

    def ready(self, timeout: float | None = None) -> Worker:
        deadline = time.monotonic() + (READY_TIMEOUT if timeout is None else timeout)
        while "worker ready on" not in self.output():
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.role} worker exited with {self.p.returncode}:\n{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role} worker not ready:\n{self.output()[-4000:]}")
            time.sleep(0.2)
        return self

    def call(self, make: object, timeout: float = 30.0) -> object:
        """Send one control message (make(call_id)) and return the decoded answer."""
        import zmq

        from kvseal.auth.curve import as_client
        from kvseal.wire import protocol as P

        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
        try:
            as_client(sock, self.client_keys, self.server_key, f"{self.role} worker")  # type: ignore[arg-type]
            sock.connect(f"tcp://{self.endpoint}")
            sock.send(P.encode(make(1)))  # type: ignore[operator]
            return P.decode(sock.recv())
        finally:
            sock.close(0)
            ctx.term()

    def info(self) -> dict:
        from kvseal.wire import protocol as P

        resp = self.call(lambda cid: P.InfoReq(call_id=cid))
        assert isinstance(resp, P.InfoResp)
        return resp.to_json()



class FaultFile:
    """Test faults a fleet shares and tests change at run time: every process of the fleet is started with
    `args()` (the same --test-faults, so the router's fleet check passes), and set() writes the file that
    kvseal/faults.py re-reads, then waits until each worker reports the new faults in /info."""

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="kvseal-faults-", suffix=".txt")
        os.close(fd)

    def args(self) -> list[str]:
        return ["--test-faults", f"file={self.path}"]

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)

    def set(self, spec: str, *workers: Worker, timeout: float = 10.0) -> None:
        from kvseal.faults import parse

        want = parse(f"{spec},file={self.path}" if spec else f"file={self.path}").canonical()
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(spec)
        for w in workers:
            wait_until(lambda w=w: w.info()["test_faults_active"] == want, timeout, f"{w.role} faults {want!r}")


def wait_until(cond: object, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = cond()  # type: ignore[operator]
        if last:
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} did not hold within {timeout}s (last: {last!r})")

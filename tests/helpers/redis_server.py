"""A real redis-server on loopback for the shared-state tests (Debian's redis-server, installed by the setup), with
a password; it can be stopped and started again on the same port (the restart tests)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from tests.helpers.procs import free_port

PASSWORD = "test-redis-password-5c1f"


class RedisServer:
    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        assert exe is not None, "redis-server is not installed: run `make setup` (scripts/setup.sh installs it)"
        self.exe, self.port = exe, free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kvseal-redis-"))
        self.password_file = self.dir / "password"
        self.password_file.write_text(PASSWORD + "\n")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.p: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> RedisServer:
        self.p = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--requirepass", PASSWORD,
                                   "--save", "", "--appendonly", "no", "--dir", str(self.dir)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client()
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.p.poll() is not None:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=PASSWORD)

    def dump(self) -> bytes:
        """Every key and every value in the server, as raw bytes: what someone holding Redis's data holds."""
        c = self.client()
        out = []
        for key in c.scan_iter(count=1000):
            out.append(key)
            kind = c.type(key)
            if kind == b"string":
                out.append(c.get(key) or b"")
            elif kind == b"hash":
                out += [b for kv in c.hgetall(key).items() for b in kv]
            elif kind == b"zset":
                out += [m for m, _ in c.zrange(key, 0, -1, withscores=True)]
            out.append(c.dump(key) or b"")
        return b"\n".join(out)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

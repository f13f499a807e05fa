"""The embed worker that `kvseal serve --embed-model` starts (unified or with a fleet), and the router's handle
on it. With fleet keys the worker gets a fresh keypair, made here in memory, and an allow-list of the router's
key alone, in its EmbedSpec on stdin (never argv or the environment); the router pins the worker's key."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import msgspec

from kvseal.auth.keys import MemberKeys, fresh_member
from kvseal.config_fleet import EmbedConfig
from kvseal.embed.client import EmbedClient
from kvseal.embed.folder import EmbedFolder
from kvseal.embed.spec import EmbedSpec
from kvseal.wire.protocol import LAUNCHER_PID_ENV


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbedSide:
    """The embed worker process and the router's client for it; stop() ends the process."""

    def __init__(self, cfg: EmbedConfig, log_level: str, router_keys: MemberKeys | None) -> None:
        assert cfg.model is not None
        folder = EmbedFolder(cfg.model)  # a folder kvseal cannot embed with stops the start here, not in a worker
        port = _free_port()
        member = fresh_member().with_allowed((router_keys.public,)) if router_keys is not None else None
        spec = EmbedSpec(model=cfg.model, port=port, threads=cfg.threads or os.cpu_count() or 1,
                         batch_tokens=cfg.batch_tokens, log_level=log_level, keys=member)
        # OpenMP threads that sleep while they wait, unless the user chose: the encoder runs many short parallel
        # regions (attention input by input), and threads spinning for a core that another process holds made a
        # batch 2-3x slower on a busy 2-core machine (docs/benchmarks.md, embeddings)
        env = {**os.environ, LAUNCHER_PID_ENV: str(os.getpid()),
               "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvseal.embed.worker"], stdin=subprocess.PIPE, env=env)
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgspec.json.encode(spec))
        self.proc.stdin.close()
        self.client = EmbedClient(f"tcp://127.0.0.1:{port}", folder, cfg.served_name, router_keys,
                                  member.public if member is not None else None)
        self.client.gone = lambda: self.proc.poll() is not None

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

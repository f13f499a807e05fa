"""A worker process from one typed message: `WorkerSpec` says everything it runs with (role, the frozen
EngineConfig, sockets, threads, timeouts, test faults). `kvseal prefill|decode` builds it from its flags;
`kvseal serve` (launch.Fleet) sends it as JSON on the worker's stdin to `python -m kvseal.worker.run`, so the
parent's settings reach its workers as they are, never turned back into a command line.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys

import msgspec

from kvseal.auth.curve import check_bind
from kvseal.auth.keys import MemberKeys
from kvseal.config import EngineConfig
from kvseal.wire.roles import Role

SPEC_VERSION = 1


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    role: Role  # PREFILL | DECODE
    engine: EngineConfig
    host: str = "127.0.0.1"  # the control socket
    port: int = 0  # 0: any free port
    kv_host: str | None = None  # decode: where KV arrives (default: host)
    kv_port: int = 0
    threads: int | None = None  # torch and kernel threads in this process (None: torch's default)
    log_level: str = "info"
    test_faults: str | None = None  # kvseal/faults.py; None in production
    transfer_timeout_s: float = 60.0  # prefill: wait for decode's acknowledgement of a handoff
    reservation_timeout_s: float = 120.0  # decode: a reservation waits this long for its KV
    drain_timeout_s: float = 600.0
    router: str | None = None  # join a running router at this fleet endpoint (tcp://HOST:PORT)
    # the address the router (and, for decode's KV port, prefill) should connect to (default: host and kv_host)
    advertise_host: str | None = None
    metrics_port: int = 0  # Prometheus /metrics on host:this (0: any free port, -1: off)
    # the metrics token's SHA-256 (hex; metrics/token.py): a scrape with it sees every tenant's figures; None: nobody
    metrics_token_sha256: str | None = None
    kv_transport: str = "zmq"  # "zmq" | "nixl" (kvseal/transfer/)
    # fleet keys: this worker's keypair and allow-list (kvseal/auth); None: plain ZeroMQ, loopback only
    keys: MemberKeys | None = None
    router_key: str | None = None  # with `router` and keys: the router's public key, pinned by the join
    kv_channel: str = "mac"  # decode with keys, zmq transport: "mac" (KV bytes in clear, MACs) | "curve" (encrypted)
    v: int = SPEC_VERSION

    def __post_init__(self) -> None:
        if self.role not in (Role.PREFILL, Role.DECODE):
            raise ValueError(f"invalid role={self.role!r}: use prefill or decode")
        if self.kv_channel not in ("mac", "curve"):
            raise ValueError(f"invalid kv_channel={self.kv_channel!r}: use mac or curve")
        if self.kv_transport not in ("zmq", "nixl"):
            raise ValueError(f"invalid kv_transport={self.kv_transport!r}: use zmq or nixl")
        if self.metrics_token_sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.metrics_token_sha256):
            raise ValueError("invalid metrics_token_sha256: expected 64 lowercase hex digits (the token's SHA-256; "
                             "kvseal.metrics.token.token_sha256 reads a --metrics-token-file)")
        if self.v != SPEC_VERSION:
            raise ValueError(f"worker spec v{self.v} is not v{SPEC_VERSION}: start the worker with the same kvseal")
        if self.router and self.keys is not None and not self.router_key:
            raise ValueError(f"invalid --router={self.router!r} with fleet keys: name the router's member as "
                             f"NAME@HOST:PORT (default name: router) so the join pins its key")

    def check_binds(self) -> None:
        """Refuse a control or KV port off loopback without fleet keys (ValueError naming the fix)."""
        check_bind(self.host, self.keys, f"{self.role} worker's control port", "--host")
        if self.role == Role.DECODE:
            check_bind(self.kv_host or self.host, self.keys, "decode worker's KV port", "--kv-host")


def run_worker(spec: WorkerSpec) -> int:
    from kvseal.engine.engine import Engine
    from kvseal.faults import hooks_from_spec
    from kvseal.worker.decode import DecodeWorker
    from kvseal.worker.join import Registrations
    from kvseal.worker.prefill import PrefillWorker
    from kvseal.worker.server import WorkerServer

    if spec.threads is not None:
        import torch

        torch.set_num_threads(max(1, spec.threads))
    spec.check_binds()
    hooks = hooks_from_spec(spec.test_faults, f"kvseal {spec.role}")
    cfg = spec.engine
    scrub = hooks.scrub_pages(cfg.cache.scrub)
    if scrub != cfg.cache.scrub:
        cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, scrub=scrub))
    bind = f"tcp://{spec.host}:{spec.port}"
    server: WorkerServer
    if spec.role == Role.PREFILL:
        server = PrefillWorker(Engine(cfg, role=Role.PREFILL), bind, hooks, spec.transfer_timeout_s,
                               spec.drain_timeout_s, spec.kv_transport, spec.keys)
    else:
        kv_bind = f"tcp://{spec.kv_host or spec.host}:{spec.kv_port}"
        server = DecodeWorker(Engine(cfg, role=Role.DECODE), bind, kv_bind, hooks,
                              spec.reservation_timeout_s, spec.drain_timeout_s, spec.kv_transport, spec.keys,
                              spec.kv_channel, spec.advertise_host)
    if spec.metrics_port >= 0:
        logging.getLogger("kvseal").info(
            "metrics on %s (per-tenant figures: %s)", server.metrics.serve(spec.host, spec.metrics_port,
                                                                             spec.metrics_token_sha256),
            "with the metrics token" if spec.metrics_token_sha256 else "off, no --metrics-token-file")
    if spec.router:
        port = server.endpoint.rsplit(":", 1)[1]
        server.join = Registrations(server.ctx, spec.router, spec.role,
                                    f"tcp://{spec.advertise_host or spec.host}:{port}", spec.keys, spec.router_key)
    return server.run()


def main() -> int:
    """`python -m kvseal.worker.run` with a WorkerSpec as JSON on stdin (what launch.Fleet starts)."""
    try:
        spec = msgspec.json.decode(sys.stdin.buffer.read(), type=WorkerSpec)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        print(f"kvseal worker: refusing its start message: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=spec.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_worker(spec)
    except ValueError as exc:  # configuration errors: name the field, the value and the fix
        print(f"kvseal: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

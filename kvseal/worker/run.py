"""A worker process from one typed message: `WorkerSpec` says everything it runs with: its role and its configs
as they are (the frozen EngineConfig, WorkerConfig, TransportConfig and ProcessConfig), and what its files held
(its fleet keys, the router's pinned key, the metrics token's digest). `kvseal prefill|decode` builds it from its
flags (cli/worker.py); `kvseal serve` (launch.Fleet) sends it as JSON on the worker's stdin to
`python -m kvseal.worker.run`, so the parent's settings reach its workers as they are, never turned back into a
command line.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys

import msgspec

from kvseal.auth.curve import check_bind
from kvseal.auth.keys import MemberKeys
from kvseal.auth.options import peer_endpoint
from kvseal.config import EngineConfig
from kvseal.config_fleet import ProcessConfig, TransportConfig, WorkerConfig
from kvseal.wire.roles import Role
from kvseal.worker.cores import LendSpec

SPEC_VERSION = 2  # 2: the worker's, transport's and process's settings are their config objects


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    role: Role  # PREFILL | DECODE
    engine: EngineConfig
    worker: WorkerConfig = WorkerConfig()  # sockets, threads, the router to join, drain
    transport: TransportConfig = TransportConfig()  # the KV transport, the KV port, the handoff's timeouts
    process: ProcessConfig = ProcessConfig()  # log level, test faults
    # the metrics token's SHA-256 (hex; metrics/token.py): a scrape with it sees every tenant's figures; None: nobody
    metrics_token_sha256: str | None = None
    # fleet keys: this worker's keypair and allow-list (kvseal/auth); None: plain ZeroMQ, loopback only
    keys: MemberKeys | None = None
    router_key: str | None = None  # with worker.router and keys: the router's public key, pinned by the join
    lend: LendSpec | None = None  # `kvseal serve`'s workers: their place in the host's core-lending table
    v: int = SPEC_VERSION

    def __post_init__(self) -> None:
        if self.role not in (Role.PREFILL, Role.DECODE):
            raise ValueError(f"invalid role={self.role!r}: use prefill or decode")
        if self.metrics_token_sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.metrics_token_sha256):
            raise ValueError("invalid metrics_token_sha256: expected 64 lowercase hex digits (the token's SHA-256; "
                             "kvseal.metrics.token.token_sha256 reads a --metrics-token-file)")
        if self.v != SPEC_VERSION:
            raise ValueError(f"worker spec v{self.v} is not v{SPEC_VERSION}: start the worker with the same kvseal")
        if self.worker.router and self.keys is not None and not self.router_key:
            raise ValueError(f"invalid --router={self.worker.router!r} with fleet keys: name the router's member as "
                             f"NAME@HOST:PORT (default name: router) so the join pins its key")

    def check_binds(self) -> None:
        """Refuse a control or KV port off loopback without fleet keys (ValueError naming the fix)."""
        check_bind(self.worker.host, self.keys, f"{self.role} worker's control port", "--host")
        if self.role == Role.DECODE:
            check_bind(self.transport.kv_host or self.worker.host, self.keys, "decode worker's KV port", "--kv-host")


def run_worker(spec: WorkerSpec) -> int:
    from kvseal.engine.engine import Engine
    from kvseal.faults import hooks_from_spec
    from kvseal.worker.decode import DecodeWorker
    from kvseal.worker.join import Registrations
    from kvseal.worker.prefill import PrefillWorker
    from kvseal.worker.server import WorkerServer

    w, t = spec.worker, spec.transport
    if w.threads is not None:
        import torch

        torch.set_num_threads(max(1, w.threads))
    spec.check_binds()
    hooks = hooks_from_spec(spec.process.test_faults, f"kvseal {spec.role}")
    cfg = spec.engine
    scrub = hooks.scrub_pages(cfg.cache.scrub)
    if scrub != cfg.cache.scrub:
        cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, scrub=scrub))
    bind = f"tcp://{w.host}:{w.port}"
    server: WorkerServer
    if spec.role == Role.PREFILL:
        server = PrefillWorker(Engine(cfg, role=Role.PREFILL), bind, hooks, t.transfer_timeout_s,
                               w.drain_timeout_s, t.kv_transport, spec.keys)
    else:
        kv_bind = f"tcp://{t.kv_host or w.host}:{t.kv_port}"
        server = DecodeWorker(Engine(cfg, role=Role.DECODE), bind, kv_bind, hooks,
                              t.reservation_timeout_s, w.drain_timeout_s, t.kv_transport, spec.keys,
                              t.kv_channel, w.advertise_host)
    if w.metrics_port >= 0:
        logging.getLogger("kvseal").info(
            "metrics on %s (per-tenant figures: %s)", server.metrics.serve(w.host, w.metrics_port,
                                                                             spec.metrics_token_sha256),
            "with the metrics token" if spec.metrics_token_sha256 else "off, no --metrics-token-file")
    if spec.lend is not None:
        from kvseal.worker.cores import CoreLending

        # only the fast arithmetic computes the same bits on any number of threads (tests/e2e/test_lent_cores.py)
        server.lending = CoreLending(spec.lend, share=server.engine.arithmetic.fast)
    if w.router:
        port = server.endpoint.rsplit(":", 1)[1]
        server.join = Registrations(server.ctx, peer_endpoint(w.router), spec.role,
                                    f"tcp://{w.advertise_host or w.host}:{port}", spec.keys, spec.router_key)
    return server.run()


def main() -> int:
    """`python -m kvseal.worker.run` with a WorkerSpec as JSON on stdin (what launch.Fleet starts)."""
    try:
        spec = msgspec.json.decode(sys.stdin.buffer.read(), type=WorkerSpec)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        print(f"kvseal worker: refusing its start message: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=spec.process.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_worker(spec)
    except ValueError as exc:  # configuration errors: name the field, the value and the fix
        print(f"kvseal: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`kvseal prefill` and `kvseal decode`: one worker of a fleet, for a cluster one per host or GPU. Their flags: the
engine's, WorkerConfig's, the process's, the fleet keys, the metrics token, and TransportConfig's fields of the
role; the worker runs with those configs as they are, in one WorkerSpec (worker/run.py), nothing copied by hand."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kvseal.auth.options import add_fleet_key_args, member_keys, peer
from kvseal.cli.base import Subparsers, command
from kvseal.config_args import add_config_args, add_engine_args, config_from_args, engine_config
from kvseal.config_fleet import ProcessConfig, TransportConfig, WorkerConfig
from kvseal.metrics.token import add_metrics_token_arg, token_sha256

if TYPE_CHECKING:
    from kvseal.worker.run import WorkerSpec

# the transport's fields each role uses: prefill sends and waits for decode's acknowledgement; decode binds the KV
# port, holds reservations and chooses the channel
TRANSPORT = {"prefill": ("kv_transport", "transfer_timeout_s"),
             "decode": ("kv_transport", "kv_host", "kv_port", "reservation_timeout_s", "kv_channel")}


def add_parsers(sub: Subparsers[argparse.ArgumentParser]) -> None:
    for role, fields in TRANSPORT.items():
        p = command(sub, role, f"run one {role} worker (for a cluster: one per host or GPU)")
        add_engine_args(p)
        add_config_args(p, WorkerConfig)
        add_config_args(p, ProcessConfig)
        add_fleet_key_args(p)
        add_metrics_token_arg(p)
        add_config_args(p, TransportConfig, only=fields)
        p.set_defaults(func=cmd_worker)


def cmd_worker(a: argparse.Namespace) -> int:
    from kvseal.worker.run import run_worker

    return run_worker(worker_spec(a))


def worker_spec(a: argparse.Namespace) -> WorkerSpec:
    """The worker's one start message: its role, its configs from the flags, and what its files hold (its fleet
    keys, the router's pinned key, the metrics token's digest)."""
    from kvseal.wire.roles import Role
    from kvseal.worker.run import WorkerSpec

    keys = member_keys(a, a.command)
    worker = config_from_args(WorkerConfig, a)
    router_key = peer(a, worker.router, keys, "router")[1] if worker.router else None
    return WorkerSpec(role=Role(a.command), engine=engine_config(a), worker=worker,
                      transport=config_from_args(TransportConfig, a), process=config_from_args(ProcessConfig, a),
                      keys=keys, router_key=router_key, metrics_token_sha256=token_sha256(a.metrics_token_file))

"""`kvseal serve [MODEL]`: the OpenAI API over prefill and decode worker processes on this host, or one process
with --unified. Its flags: the engine's, the HTTP front's, ServeConfig's, and of the worker, router, handoff and
transport fields those a fleet on one host takes. Each worker gets the parent's configs as they are, in its
WorkerSpec (worker_specs), and the router is `kvseal router`'s (run_router)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import TYPE_CHECKING

import msgspec

from kvseal.auth.options import add_fleet_key_args, member_keys
from kvseal.cli.base import Subparsers, command
from kvseal.cli.front import add_server_args, chat_template, one_tenant_notice, serve_http, server_config
from kvseal.cli.router import fleet_host, run_router
from kvseal.config_args import add_config_args, add_engine_args, config_from_args, engine_config
from kvseal.config_fleet import (
    EmbedConfig,
    HandoffTimeouts,
    ProcessConfig,
    RouterConfig,
    ServeConfig,
    TransportConfig,
    WorkerConfig,
)
from kvseal.metrics.token import add_metrics_token_arg, token_sha256

if TYPE_CHECKING:
    from kvseal.auth.keys import MemberKeys
    from kvseal.embed.launch import EmbedSide
    from kvseal.worker.run import WorkerSpec

# what a fleet on one host takes of the process configs: its workers bind loopback ports of their own, find the
# router in their launcher, and keep the other fields' defaults
SERVE_WORKER = ("threads",)
SERVE_ROUTER = ("fleet_port", "fleet_host", "startup_timeout_s")
SERVE_TRANSPORT = ("kv_channel", "kv_transport")


def add_parser(sub: Subparsers[argparse.ArgumentParser]) -> None:
    from kvseal.ledger.store import default_path

    p = command(sub, "serve", "serve a model with the OpenAI API")
    add_engine_args(p, ledger_default=default_path())
    add_config_args(p, WorkerConfig, only=SERVE_WORKER)
    add_server_args(p)
    add_config_args(p, ServeConfig)
    add_config_args(p, RouterConfig, only=SERVE_ROUTER)
    add_config_args(p, HandoffTimeouts)
    add_fleet_key_args(p, serve=True)
    add_metrics_token_arg(p, serve=True)
    add_config_args(p, TransportConfig, only=SERVE_TRANSPORT)
    add_config_args(p, EmbedConfig)
    p.set_defaults(func=cmd_serve)


def cmd_serve(a: argparse.Namespace) -> int:
    if config_from_args(ServeConfig, a).unified:
        return cmd_serve_unified(a)
    from kvseal.launch import Fleet

    scfg, template = server_config(a), chat_template(a)  # a bad --api-keys or template: no worker starts
    serve, rcfg = config_from_args(ServeConfig, a), config_from_args(RouterConfig, a)
    keys = member_keys(a, "router")  # fresh unless --fleet-keys DIR or off
    fleet_host(rcfg, scfg, keys)
    cores = os.cpu_count() or 1
    prefill_spec, decode_spec = worker_specs(a, cores)
    embed = embed_side(a, keys)  # a folder it cannot embed with stops the start before any worker does
    try:
        with Fleet(prefill_spec, decode_spec, serve.prefill, serve.decode, keys,
                   cores if serve.lend_cores else None) as fleet:
            return run_router(a, scfg, fleet.prefill_endpoints, fleet.decode_endpoints, template,
                              fleet.router_keys, fleet.server_keys, embed)
    finally:
        if embed is not None:
            embed.stop()


def embed_side(a: argparse.Namespace, keys: MemberKeys | None) -> EmbedSide | None:
    """The embed worker of --embed-model (None without it), its channel keyed with the router's fleet keys."""
    cfg = config_from_args(EmbedConfig, a)
    if cfg.model is None:
        return None
    from kvseal.embed.launch import EmbedSide

    return EmbedSide(cfg, config_from_args(ProcessConfig, a).log_level, keys)


def worker_specs(a: argparse.Namespace, cores: int) -> tuple[WorkerSpec, WorkerSpec]:
    """What `kvseal serve` starts its prefill and decode workers with: this process's configs as they are (the
    engine's, with the prefill pool from --prefill-kv-pool-tokens if given; the transport's; the process's, test
    faults included, given to every process of the fleet and never through the environment), and threads per
    role."""
    from kvseal.wire.roles import Role
    from kvseal.worker.run import WorkerSpec

    cfg, serve = engine_config(a), config_from_args(ServeConfig, a)
    prefill_cfg = cfg if serve.prefill_kv_pool_tokens is None else dataclasses.replace(
        cfg, cache=dataclasses.replace(cfg.cache, pool_tokens=serve.prefill_kv_pool_tokens, pool_bytes=None))
    p_threads, d_threads = worker_threads(a, cores)
    decode = WorkerSpec(role=Role.DECODE, engine=cfg, worker=WorkerConfig(threads=d_threads),
                        transport=config_from_args(TransportConfig, a), process=config_from_args(ProcessConfig, a),
                        metrics_token_sha256=token_sha256(a.metrics_token_file))
    return (msgspec.structs.replace(decode, role=Role.PREFILL, engine=prefill_cfg,
                                    worker=WorkerConfig(threads=p_threads)), decode)


def worker_threads(a: argparse.Namespace, cores: int) -> tuple[int, int]:
    """(threads per prefill worker, threads per decode worker) for `kvseal serve` on `cores` cores.

    --prefill-threads / --decode-threads win, then --threads for both; by default the cores are split evenly
    among the workers (each at least one), so no two workers spin on the same core."""
    serve, threads = config_from_args(ServeConfig, a), config_from_args(WorkerConfig, a).threads
    even = max(1, cores // (serve.prefill + serve.decode))
    both = threads if threads is not None else even
    return (serve.prefill_threads or both, serve.decode_threads or both)


def cmd_serve_unified(a: argparse.Namespace) -> int:
    from kvseal.engine.engine import Engine
    from kvseal.kernels.ops import one_thread_here
    from kvseal.worker.unified import UnifiedBackend

    if a.metrics_token_file is not None:
        raise ValueError(f"invalid --metrics-token-file={a.metrics_token_file!r} with --unified: that server has no "
                         f"worker metrics port (its engine's per-tenant figures are on /metrics, for admin keys); "
                         f"drop the flag, or serve without --unified")
    cfg, scfg, template = engine_config(a), server_config(a), chat_template(a)
    # before the engine loads: a folder it cannot embed with stops the start; the worker loads meanwhile (it exits
    # with this process, whatever stops it)
    embed = embed_side(a, member_keys(a, "router"))  # fresh keys for its channel unless --fleet-keys off
    threads = config_from_args(WorkerConfig, a).threads
    if threads is not None:
        import torch

        torch.set_num_threads(max(1, threads))
    # every step runs on the engine loop's thread with the threads torch has (every core unless --threads): the
    # HTTP side is a few events a step and needs no core of its own (1.32x the tok/s of leaving it one at 32
    # streams on the 1.5B). This thread loads on one, so the loop's is the process's only OpenMP team
    # (kernels.ops.one_thread_here; docs/benchmarks.md, issue 32)
    loop_threads = one_thread_here()
    engine = Engine(cfg)
    backend = UnifiedBackend(engine, cfg.model.served_name, template, loop_threads)
    kv = engine.kv_spec
    logging.getLogger("kvseal").info(
        "serving %s (%s) on http://%s:%d: context window %d tokens, KV pool %d tokens (%d pages of %d), "
        "kv dtype %s, scrub %s, ledger %s", backend.model_name, kv.model_fingerprint, scfg.host, scfg.port,
        engine.context_window, engine.pool.capacity_tokens, engine.pool.num_pages, engine.pool.page_size,
        kv.kv_dtype, "on" if cfg.cache.scrub else "off", cfg.ledger.path or "off")
    one_tenant_notice(scfg)
    try:
        serve_http(backend, scfg, config_from_args(ProcessConfig, a).log_level, engine,
                   embed.client if embed is not None else None)
    finally:
        if embed is not None:
            embed.stop()
    if engine.ledger is not None:
        engine.ledger.close()
    return 0

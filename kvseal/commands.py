"""What each `kvseal` command does, given its parsed flags (kvseal/cli.py builds the parser and sets `func`)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvseal import config_args
from kvseal.auth.curve import check_bind
from kvseal.auth.options import member_keys, peer
from kvseal.config import ServerConfig
from kvseal.config_args import engine_config, ledger_path
from kvseal.errors import KvsealError
from kvseal.metrics.token import token_sha256

if TYPE_CHECKING:
    from kvseal.auth.keys import MemberKeys
    from kvseal.embed.client import EmbedClient
    from kvseal.embed.launch import EmbedSide
    from kvseal.engine.engine import Engine
    from kvseal.router.disagg import DisaggBackend
    from kvseal.worker.run import WorkerSpec


def server_config(a: argparse.Namespace) -> ServerConfig:
    from kvseal.router.tenant_file import TenantsFile, read_tenants_file

    f = read_tenants_file(a.api_keys) if a.api_keys is not None else TenantsFile((), (), ())
    return config_args.server_config(a, api_keys=f.keys, admin_keys=f.admins, tenants=f.tenants)


def chat_template(a: argparse.Namespace) -> str | None:
    """The text of --chat-template FILE (None without the flag); an unreadable file stops the start."""
    if a.chat_template is None:
        return None
    from kvseal.model.chat_template import compile_chat_template

    try:
        source = Path(a.chat_template).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"invalid --chat-template={a.chat_template!r}: cannot read it as UTF-8 text "
                         f"({type(exc).__name__}); give a jinja2 template file") from None
    try:
        compile_chat_template(source)
    except ValueError as exc:
        raise ValueError(f"invalid --chat-template={a.chat_template!r}: {exc}") from None
    return source


def cmd_worker(a: argparse.Namespace) -> int:
    from kvseal.worker.run import WorkerSpec, run_worker

    keys = member_keys(a, a.command)
    router, router_key = peer(a, a.router, keys, "router") if a.router else (None, None)
    return run_worker(WorkerSpec(
        role=a.command, engine=engine_config(a), host=a.host, port=a.port, threads=a.threads,
        log_level=a.log_level, test_faults=a.test_faults, drain_timeout_s=a.drain_timeout,
        router=router, advertise_host=a.advertise_host, keys=keys, router_key=router_key,
        metrics_port=a.metrics_port, metrics_token_sha256=token_sha256(a.metrics_token_file),
        kv_transport=a.kv_transport,
        **({"transfer_timeout_s": a.transfer_timeout} if a.command == "prefill" else
           {"kv_host": a.kv_host, "kv_port": a.kv_port, "reservation_timeout_s": a.reservation_timeout,
            "kv_channel": a.kv_channel})))


def fleet_host(a: argparse.Namespace, keys: MemberKeys | None) -> str:
    """Where the router's fleet socket binds; off loopback only with keys (ValueError naming the fix)."""
    host = a.fleet_host or a.host
    check_bind(host, keys, "router's fleet port (--fleet-host, default --host)", "--fleet-host" if a.fleet_host
               else "--host")
    return str(host)


def one_tenant_notice(scfg: ServerConfig) -> None:
    if not scfg.api_keys:
        logging.getLogger("kvseal").warning(
            "no --api-keys: every client is one tenant and shares one prefix cache (a response's cached_tokens "
            "shows which prompt prefixes anyone sent before), and /info and /metrics show the whole fleet to "
            "everyone; give --api-keys FILE to keep tenants apart")


def run_router(a: argparse.Namespace, scfg: ServerConfig, prefill: list[str], decode: list[str],
               template: str | None, keys: MemberKeys | None = None,
               server_keys: dict[str, str] | None = None, embed: EmbedSide | None = None) -> int:
    from kvseal.faults import hooks_from_spec
    from kvseal.ledger.store import Ledger
    from kvseal.model.loader import load_tokenizer
    from kvseal.router.disagg import DisaggBackend

    hooks = hooks_from_spec(a.test_faults, "kvseal router")
    tokenizer, name = load_tokenizer(a.model)
    path = ledger_path(a)
    ledger = Ledger(path) if path else None
    if template is not None:
        tokenizer = tokenizer.with_chat_template(template)
    backend = DisaggBackend(tokenizer, a.served_model_name or name, prefill, decode,
                            max_model_len=a.max_model_len, hooks=hooks,
                            fleet_bind=f"tcp://{fleet_host(a, keys)}:{a.fleet_port}", ledger=ledger, keys=keys,
                            server_keys=server_keys)
    logging.getLogger("kvseal").info("router on http://%s:%d: prefill %s, decode %s; ledger %s; fleet %s", scfg.host,
                                     scfg.port, prefill, decode, path or "off",
                                     "authenticated and encrypted (CURVE)" if keys is not None else "without keys")
    one_tenant_notice(scfg)
    try:  # seal 7 before the first request: a fleet that cannot hold the window never serves
        asyncio.run(_probe(backend))
    except KvsealError as err:
        print(f"kvseal router: refusing to start: {err.message}", file=sys.stderr)
        return 3
    serve_http(backend, scfg, a.log_level, embedder=embed.client if embed is not None else None)
    if ledger is not None:
        ledger.close()
    return 0


def serve_http(backend: Any, scfg: ServerConfig, log_level: str, engine: Engine | None = None,
               embedder: EmbedClient | None = None) -> None:
    """The OpenAI app over `backend` (the router's or the unified engine's), with /metrics (and the engine's own
    figures when it runs in this process) and /doctor/probe, served until SIGTERM or SIGINT; with an embedder,
    /v1/embeddings too."""
    import uvicorn

    from kvseal.metrics.engine import EngineCollector, TenantCollector, WorkerMetrics
    from kvseal.metrics.router import MeteredBackend, RouterMetrics
    from kvseal.metrics.router import install as install_metrics
    from kvseal.router.api import build_app
    from kvseal.router.probe import install_probe

    metrics = RouterMetrics(backend)
    if engine is not None:
        WorkerMetrics(EngineCollector(engine, labels={"endpoint": f"{scfg.host}:{scfg.port}"}), metrics.registry)
        metrics.registry.register(TenantCollector(engine))  # this /metrics is admin keys' only: tenants may show
    app = build_app(MeteredBackend(backend, metrics), scfg, embedder)
    if embedder is not None:
        from kvseal.embed.metrics import EmbedMetrics

        app.state.embed_metrics = EmbedMetrics(metrics.registry, lambda: embedder.last_card.queued_inputs
                                               if embedder.last_card is not None else 0)
    install_metrics(app, metrics)
    install_probe(app, backend)
    uvicorn.run(app, host=scfg.host, port=scfg.port, log_level=log_level, timeout_graceful_shutdown=5)


def cmd_drain(a: argparse.Namespace) -> int:
    """Ask a worker to drain: it takes no new request, finishes those in flight, then exits."""
    import zmq

    from kvseal.auth.curve import as_client
    from kvseal.worker import protocol as P

    keys = member_keys(a, "drain")
    endpoint, key = peer(a, a.worker, keys, None)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        as_client(sock, keys, key, f"worker at {a.worker}")
        sock.connect(endpoint)
        sock.send(P.encode(P.DrainReq(call_id=1)))
        deadline = time.monotonic() + a.timeout
        resp: P.Message | None = None
        while not isinstance(resp, P.DrainResp):  # the worker tells every peer it drains: skip that notice
            if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                print(f"kvseal drain: {a.worker} did not answer within {a.timeout:g}s", file=sys.stderr)
                return 1
            resp = P.decode(sock.recv())
    finally:
        sock.close(0)
        ctx.term()
    print(f"{a.worker} is draining: {resp.inflight} request(s) to finish, then it exits")
    return 0


async def _probe(backend: DisaggBackend) -> None:
    try:
        await backend.start()
    finally:
        await backend.stop()


def cmd_router(a: argparse.Namespace) -> int:
    if not a.prefill or not a.decode:
        print("kvseal router: give at least one --prefill HOST:PORT and one --decode HOST:PORT", file=sys.stderr)
        return 2
    keys = member_keys(a, "router")
    fleet_host(a, keys)  # refused before anything starts
    prefill = [peer(a, x, keys, "prefill") for x in a.prefill]
    decode = [peer(a, x, keys, "decode") for x in a.decode]
    server_keys = {ep: k for ep, k in prefill + decode if k is not None}
    return run_router(a, server_config(a), [ep for ep, _ in prefill], [ep for ep, _ in decode], chat_template(a),
                      keys, server_keys)


def cmd_serve(a: argparse.Namespace) -> int:
    if a.unified:
        return cmd_serve_unified(a)
    from kvseal.launch import Fleet

    scfg, template = server_config(a), chat_template(a)  # a bad --api-keys or template: no worker starts
    keys = member_keys(a, "router")  # fresh unless --fleet-keys DIR or off
    fleet_host(a, keys)
    prefill_spec, decode_spec = worker_specs(a, os.cpu_count() or 1)
    embed = embed_side(a, keys)  # a folder it cannot embed with stops the start before any worker does
    try:
        with Fleet(prefill_spec, decode_spec, a.prefill, a.decode, keys) as fleet:
            return run_router(a, scfg, fleet.prefill_endpoints, fleet.decode_endpoints, template,
                              fleet.router_keys, fleet.server_keys, embed)
    finally:
        if embed is not None:
            embed.stop()


def embed_side(a: argparse.Namespace, keys: MemberKeys | None) -> EmbedSide | None:
    """The embed worker of --embed-model (None without it), its channel keyed with the router's fleet keys."""
    from kvseal.config_args import config_from_args
    from kvseal.embed.config import EmbedConfig

    cfg = config_from_args(EmbedConfig, a)
    if cfg.model is None:
        return None
    from kvseal.embed.launch import EmbedSide

    return EmbedSide(cfg, a.log_level, keys)


def worker_specs(a: argparse.Namespace, cores: int) -> tuple[WorkerSpec, WorkerSpec]:
    """What `kvseal serve` starts its prefill and decode workers with: this process's engine config (the
    prefill pool from --prefill-kv-pool-tokens if given), threads per role, and its test faults (given to
    every process of the fleet, never through the environment)."""
    from kvseal.worker.run import WorkerSpec

    cfg = engine_config(a)
    prefill_cfg = cfg if a.prefill_kv_pool_tokens is None else dataclasses.replace(
        cfg, cache=dataclasses.replace(cfg.cache, pool_tokens=a.prefill_kv_pool_tokens, pool_bytes=None))
    p_threads, d_threads = worker_threads(a, cores)
    common = {"log_level": a.log_level, "test_faults": a.test_faults, "kv_transport": a.kv_transport,
              "metrics_token_sha256": token_sha256(a.metrics_token_file)}
    return (WorkerSpec(role="prefill", engine=prefill_cfg, threads=p_threads, **common),
            WorkerSpec(role="decode", engine=cfg, threads=d_threads, kv_channel=a.kv_channel, **common))


def worker_threads(a: argparse.Namespace, cores: int) -> tuple[int, int]:
    """(threads per prefill worker, threads per decode worker) for `kvseal serve` on `cores` cores.

    --prefill-threads / --decode-threads win, then --threads for both; by default the cores are split evenly
    among the workers (each at least one), so no two workers spin on the same core."""
    even = max(1, cores // (a.prefill + a.decode))
    both = a.threads if a.threads is not None else even
    return (a.prefill_threads or both, a.decode_threads or both)


def cmd_serve_unified(a: argparse.Namespace) -> int:
    from kvseal.engine.engine import Engine
    from kvseal.worker.unified import UnifiedBackend

    if a.metrics_token_file is not None:
        raise ValueError(f"invalid --metrics-token-file={a.metrics_token_file!r} with --unified: that server has no "
                         f"worker metrics port (its engine's per-tenant figures are on /metrics, for admin keys); "
                         f"drop the flag, or serve without --unified")
    cfg, scfg, template = engine_config(a), server_config(a), chat_template(a)
    # before the engine loads: a folder it cannot embed with stops the start; the worker loads meanwhile (it exits
    # with this process, whatever stops it)
    embed = embed_side(a, member_keys(a, "router"))  # fresh keys for its channel unless --fleet-keys off
    if a.threads is not None:
        import torch

        torch.set_num_threads(max(1, a.threads))
    engine = Engine(cfg)
    cores = os.cpu_count() or 1
    if a.threads is None and cores >= 2:
        # the HTTP side (parsing, templates, one SSE event per token) runs in this process too: decode steps leave
        # it a core (measured on 2 cores: 1.2-1.9x the tok/s of two engine threads over HTTP, docs/benchmarks.md),
        # prompt chunks of 256 tokens and more take every core
        engine.step_threads = (cores - 1, cores, 256)
    backend = UnifiedBackend(engine, cfg.model.served_name, template)
    kv = engine.kv_spec
    logging.getLogger("kvseal").info(
        "serving %s (%s) on http://%s:%d: context window %d tokens, KV pool %d tokens (%d pages of %d), "
        "kv dtype %s, scrub %s, ledger %s", backend.model_name, kv.model_fingerprint, scfg.host, scfg.port,
        engine.context_window, engine.pool.capacity_tokens, engine.pool.num_pages, engine.pool.page_size,
        kv.kv_dtype, "on" if cfg.cache.scrub else "off", cfg.ledger.path or "off")
    one_tenant_notice(scfg)
    try:
        serve_http(backend, scfg, a.log_level, engine, embed.client if embed is not None else None)
    finally:
        if embed is not None:
            embed.stop()
    if engine.ledger is not None:
        engine.ledger.close()
    return 0


def cmd_audit(a: argparse.Namespace) -> int:
    from kvseal.audit.__main__ import run_audit

    return run_audit(a)


def cmd_doctor(a: argparse.Namespace) -> int:
    from kvseal.doctor import run_doctor

    return run_doctor(a)


def cmd_incidents(a: argparse.Namespace) -> int:
    from kvseal.ledger.incidents import run_incidents

    return run_incidents(a)


def cmd_bench(a: argparse.Namespace) -> int:
    from kvseal.bench.load.__main__ import run_bench

    return run_bench(a)

"""kvseal's command line: `kvseal serve [MODEL]` and friends. `--help` documents every flag."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvseal.auth.curve import check_bind
from kvseal.auth.options import add_fleet_key_args, add_keys_command, add_kv_channel_arg, member_keys, peer
from kvseal.config import (
    CacheConfig,
    EngineConfig,
    GrammarConfig,
    LedgerConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)
from kvseal.errors import KvsealError

if TYPE_CHECKING:
    from kvseal.auth.keys import MemberKeys
    from kvseal.router.disagg import DisaggBackend
    from kvseal.worker.run import WorkerSpec


def _on_off(v: str) -> bool:
    if v.lower() in ("on", "true", "1", "yes"):
        return True
    if v.lower() in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {v!r}")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file or a Hugging Face folder (Llama/Qwen2); default: the bundled "
                        "SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the model's compute dtype for the exact arithmetic with --kernels torch (bfloat16 is "
                        "several times faster on AMX CPUs); the native kernels compute in float32")
    p.add_argument("--device", default="auto", help="auto (cuda when present, else cpu), cpu or cuda[:N]")
    p.add_argument("--kernels", default="auto", choices=["auto", "torch", "native"],
                   help="native: kvseal's C kernels (GGUF Q4_0/Q4_1/Q8_0 weights used as stored, paged decode "
                        "attention; CPU, float32, AVX2); torch: torch ops on dequantized weights (matches "
                        "transformers bit for bit in float32); auto: native where it can run, else torch")
    p.add_argument("--arithmetic", default="auto", choices=["auto", "exact", "fast"],
                   help="how the native kernels compute, chosen at start-up and named in /info, the start-up log "
                        "and the fleet check. fast: int8 activations times the GGUF blocks with integer dot "
                        "products on the best of AVX-512-VNNI, AVX-VNNI or AVX2 this CPU has (the same bits on "
                        "each; float checkpoints become Q8_0 blocks at load), attention reading KV in place; "
                        "batch invariant, about 0.5%% from float32 per product (agreement: python -m "
                        "benchmarks.agreement). exact: float32 throughout, transformers' greedy tokens. "
                        "auto (default): fast where it can run (native kernels, page size a multiple of 16), "
                        "else exact")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="cap the served context window (tokens); the window is min(model, this, pool)")
    p.add_argument("--served-model-name", default=None, help="the model id in the API (default: checkpoint name)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--kv-pool-tokens", type=int, default=None,
                   help="KV pool size in tokens (default: twice the context window)")
    p.add_argument("--kv-pool-bytes", type=int, default=None, help="KV pool size in bytes (instead of tokens)")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="KV cache dtype; auto: bfloat16 with the fast arithmetic (half the KV memory, decode "
                        "reads and handoff bytes), else the model's dtype. bfloat16 needs --arithmetic fast or "
                        "--kernels torch")
    p.add_argument("--kv-scrub", type=_on_off, default=True, metavar="on|off",
                   help="zero KV pages before they return to the free list (default on)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="keep no prefix cache (by default full prompt pages are kept and shared read-only with "
                        "later requests of the same tenant and cache_salt)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="per-step token budget; longer prompts are prefilled in chunks of this size")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="requests that may wait for KV pages (in arrival order); beyond this, 503 with Retry-After")
    p.add_argument("--wait-timeout", type=float, default=60.0,
                   help="a request waiting for KV pages gets 503 when no page at all was freed for this many "
                        "seconds (a busy worker that frees pages is waited out)")
    p.add_argument("--fairness", default="vtc", choices=["vtc", "off"],
                   help="who each engine admits next when tenants compete: vtc (default; the tenant served least, "
                        "in tokens weighted by its weight from --api-keys, as the Virtual Token Counter; a tenant "
                        "alone gets everything) or off (arrival order)")
    p.add_argument("--contended-chunk-tokens", type=int, default=128,
                   help="with --fairness vtc: prompt tokens per step while more than one tenant competes (had work "
                        "within 5 s), so that a newcomer waits for a short step; a tenant alone gets "
                        "--max-num-batched-tokens chunks")
    p.add_argument("--seed", type=int, default=0, help="seed for requests that sample without their own seed")
    p.add_argument("--grammar-compilers", type=int, default=0, metavar="N",
                   help="processes that compile response_format grammars, off the engine's loop (started on the "
                        "first constrained request, idle unless compiling, at a lower CPU priority than the engine); "
                        "0: one per two cores, at most 2")
    p.add_argument("--grammar-timeout", type=float, default=30.0,
                   help="seconds a response_format grammar may take to compile; past it its process is killed and "
                        "replaced, and the request gets 400 (param response_format)")
    p.add_argument("--grammar-max-bytes", type=int, default=64 * 1024,
                   help="a response_format schema larger than this is refused with 400 before anything compiles")
    add_ledger_arg(p)
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch and the kernels in this process (default: `kvseal serve` splits the "
                        "cores among its workers; `kvseal serve --unified` uses every core for prompt chunks of "
                        "256 tokens or more and leaves one to the HTTP server on smaller steps)")


def add_ledger_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ledger", default=None, metavar="PATH|off",
                   help="the forensic ledger: an SQLite file with one row per ended request (ids, tenant, times, "
                        "workers, every page read and whose KV it held; never prompt or output text), read by "
                        "`kvseal incidents PATH`. kvseal serve: on by default (the path is shown); a role run "
                        "alone: off unless given")


def ledger_path(a: argparse.Namespace) -> str | None:
    return None if a.ledger in (None, "", "off") else str(a.ledger)


def add_kv_transport_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-transport", default="zmq", choices=["zmq", "nixl"],
                   help="how KV pages move from prefill to decode workers: zmq (ZeroMQ over TCP, a packed copy) or "
                        "nixl (NIXL over UCX: RDMA, shared memory or TCP; decode reads straight into its reserved "
                        "pages; pip install 'kvseal[nixl]'). Every worker of a fleet uses the same one")


def add_test_faults_arg(p: argparse.ArgumentParser) -> None:
    # test-only, absent from --help on purpose: kvseal/faults.py
    p.add_argument("--test-faults", default=None, help=argparse.SUPPRESS)


def engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path=a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
                          served_name=a.served_model_name, kernels=a.kernels, arithmetic=a.arithmetic),
        cache=CacheConfig(page_size=a.page_size, pool_tokens=a.kv_pool_tokens, pool_bytes=a.kv_pool_bytes,
                          scrub=a.kv_scrub, kv_dtype=a.kv_dtype, prefix_cache=not a.no_prefix_cache),
        scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                                  max_waiting=a.max_waiting, wait_timeout_s=a.wait_timeout, fairness=a.fairness,
                                  contended_chunk_tokens=a.contended_chunk_tokens),
        seed=a.seed,
        ledger=LedgerConfig(ledger_path(a)),
        grammar=GrammarConfig(grammar_compilers=a.grammar_compilers, grammar_timeout_s=a.grammar_timeout,
                              grammar_max_bytes=a.grammar_max_bytes),
    )


def add_server_args(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=port, help="port to listen on")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="require a bearer key on every route but /health: FILE has one `TENANT KEY` line per key "
                        "(# comments), optionally followed by the tenant's settings: weight=W priority_class=N "
                        "max_concurrent=N rpm=N tpm=N kv_share=F (README: Tenants); the tenant keys the prefix "
                        "cache. `TENANT KEY admin` marks an admin key: only "
                        "those see the fleet's internals (/info's workers, /metrics, /doctor/probe); a tenant's "
                        "/info shows the model, the window and its own requests. Without it: no keys, one tenant, "
                        "everyone sees everything")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="larger bodies get 413")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="render chats with the jinja2 template in FILE instead of the model's own (as vLLM's "
                        "--chat-template; /tokenize with messages uses it too)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def server_config(a: argparse.Namespace) -> ServerConfig:
    from kvseal.router.tenant_file import TenantsFile, read_tenants_file

    f = read_tenants_file(a.api_keys) if a.api_keys is not None else TenantsFile((), (), ())
    return ServerConfig(host=a.host, port=a.port, max_body_bytes=a.max_body_bytes, api_keys=f.keys,
                        admin_keys=f.admins, tenants=f.tenants)


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
        metrics_port=a.metrics_port, kv_transport=a.kv_transport,
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
               server_keys: dict[str, str] | None = None) -> int:
    import uvicorn

    from kvseal.faults import hooks_from_spec
    from kvseal.ledger.store import Ledger
    from kvseal.metrics.router import MeteredBackend, RouterMetrics
    from kvseal.metrics.router import install as install_metrics
    from kvseal.model.loader import load_tokenizer
    from kvseal.router.api import build_app
    from kvseal.router.disagg import DisaggBackend
    from kvseal.router.probe import install_probe

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
    metrics = RouterMetrics(backend)
    app = build_app(MeteredBackend(backend, metrics), scfg)
    install_metrics(app, metrics)
    install_probe(app, backend)
    uvicorn.run(app, host=scfg.host, port=scfg.port, log_level=a.log_level, timeout_graceful_shutdown=5)
    if ledger is not None:
        ledger.close()
    return 0


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
    with Fleet(prefill_spec, decode_spec, a.prefill, a.decode, keys) as fleet:
        return run_router(a, scfg, fleet.prefill_endpoints, fleet.decode_endpoints, template, fleet.router_keys,
                          fleet.server_keys)


def worker_specs(a: argparse.Namespace, cores: int) -> tuple[WorkerSpec, WorkerSpec]:
    """What `kvseal serve` starts its prefill and decode workers with: this process's engine config (the
    prefill pool from --prefill-kv-pool-tokens if given), threads per role, and its test faults (given to
    every process of the fleet, never through the environment)."""
    from kvseal.worker.run import WorkerSpec

    cfg = engine_config(a)
    prefill_cfg = cfg if a.prefill_kv_pool_tokens is None else dataclasses.replace(
        cfg, cache=dataclasses.replace(cfg.cache, pool_tokens=a.prefill_kv_pool_tokens, pool_bytes=None))
    p_threads, d_threads = worker_threads(a, cores)
    common = {"log_level": a.log_level, "test_faults": a.test_faults, "kv_transport": a.kv_transport}
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
    import uvicorn

    from kvseal.engine.engine import Engine
    from kvseal.metrics.engine import EngineCollector, WorkerMetrics
    from kvseal.metrics.router import MeteredBackend, RouterMetrics
    from kvseal.metrics.router import install as install_metrics
    from kvseal.router.api import build_app
    from kvseal.router.probe import install_probe
    from kvseal.worker.unified import UnifiedBackend

    cfg, scfg, template = engine_config(a), server_config(a), chat_template(a)
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
    info = engine.info()
    logging.getLogger("kvseal").info(
        "serving %s (%s) on http://%s:%d: context window %d tokens, KV pool %d tokens (%d pages of %d), "
        "kv dtype %s, scrub %s, ledger %s", backend.model_name, info["model_fingerprint"], scfg.host, scfg.port,
        engine.context_window, engine.pool.capacity_tokens, engine.pool.num_pages, engine.pool.page_size,
        info["kv_dtype"], "on" if cfg.cache.scrub else "off", cfg.ledger.path or "off")
    one_tenant_notice(scfg)
    metrics = RouterMetrics(backend)
    WorkerMetrics(EngineCollector(engine, labels={"endpoint": f"{scfg.host}:{scfg.port}"}), metrics.registry)
    app = build_app(MeteredBackend(backend, metrics), scfg)
    install_metrics(app, metrics)
    install_probe(app, backend)
    uvicorn.run(app, host=scfg.host, port=scfg.port, log_level=a.log_level, timeout_graceful_shutdown=5)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvseal", description="A disaggregated LLM server with sealed KV.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model with the OpenAI API",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(serve)
    add_server_args(serve, 8000)
    serve.add_argument("--unified", action="store_true",
                       help="run prefill and decode in one process (the single-process engine)")
    serve.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill worker processes")
    serve.add_argument("--decode", type=int, default=1, metavar="M", help="decode worker processes")
    serve.add_argument("--prefill-kv-pool-tokens", type=int, default=None,
                       help="a different KV pool size for the prefill workers (default: --kv-pool-tokens)")
    serve.add_argument("--prefill-threads", type=int, default=None,
                       help="CPU threads per prefill worker (default: --threads, else the cores split evenly "
                            "among the workers)")
    serve.add_argument("--decode-threads", type=int, default=None,
                       help="CPU threads per decode worker (default: as --prefill-threads)")
    serve.add_argument("--fleet-port", type=int, default=0, help="as for `kvseal router`")
    serve.add_argument("--fleet-host", default=None, help="as for `kvseal router`")
    add_fleet_key_args(serve, serve=True)
    add_kv_channel_arg(serve)
    add_kv_transport_arg(serve)
    add_test_faults_arg(serve)
    from kvseal.ledger.store import default_path

    serve.set_defaults(func=cmd_serve, ledger=default_path())

    for role in ("prefill", "decode"):
        w = sub.add_parser(role, help=f"run one {role} worker (for a cluster: one per host or GPU)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add_engine_args(w)
        w.add_argument("--host", default="127.0.0.1", help="address of the control socket")
        w.add_argument("--port", type=int, default=0, help="control port (0: any free port)")
        w.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
        w.add_argument("--router", default=None, metavar="[NAME@]HOST:PORT",
                       help="join a running router at its fleet endpoint (its --fleet-port); the router checks "
                            "this worker like one it started with (seal 7) and exits it with the reason if not. "
                            "With --fleet-keys, NAME is the router's member (default: router), whose key the join "
                            "pins")
        add_fleet_key_args(w)
        w.add_argument("--metrics-port", type=int, default=0,
                       help="serve Prometheus /metrics on this port of --host (0: any free port, shown in the log "
                            "and in /info as metrics_endpoint; -1: none)")
        w.add_argument("--advertise-host", default=None,
                       help="the address others connect to: the router's to the control port, and for a decode "
                            "worker prefill's to the KV port (default: --host and --kv-host; give the host's name "
                            "or address when they bind 0.0.0.0, as in a pod)")
        w.add_argument("--drain-timeout", type=float, default=600.0,
                       help="on SIGTERM or `kvseal drain`, seconds to finish the requests in flight before the "
                            "rest fail")
        add_kv_transport_arg(w)
        add_test_faults_arg(w)
        if role == "prefill":
            w.add_argument("--transfer-timeout", type=float, default=60.0,
                           help="seconds to wait for decode to acknowledge a KV handoff")
        else:
            w.add_argument("--kv-host", default=None, help="address for incoming KV (default: --host)")
            w.add_argument("--kv-port", type=int, default=0, help="port for incoming KV (0: any free port)")
            w.add_argument("--reservation-timeout", type=float, default=120.0,
                           help="seconds a page reservation waits for its KV before it is released")
            add_kv_channel_arg(w)
        w.set_defaults(func=cmd_worker)

    router = sub.add_parser("router", help="serve the OpenAI API in front of prefill and decode workers",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    router.add_argument("model", nargs="?", default=None, help="the checkpoint (for its tokenizer)")
    router.add_argument("--prefill", action="append", default=[], metavar="[NAME@]HOST:PORT",
                        help="a prefill worker's control endpoint (repeatable); with --fleet-keys, NAME is its "
                             "member (default: prefill), whose key the router pins")
    router.add_argument("--decode", action="append", default=[], metavar="[NAME@]HOST:PORT",
                        help="a decode worker's control endpoint (repeatable); NAME as for --prefill (default: "
                             "decode)")
    router.add_argument("--max-model-len", type=int, default=None,
                        help="the context window to serve (default: the workers' model window)")
    router.add_argument("--served-model-name", default=None, help="the model id in the API")
    router.add_argument("--fleet-port", type=int, default=0,
                        help="port where workers started with --router HOST:PORT join (0: any free port; the "
                             "one chosen is in the log and in /info as fleet_endpoint)")
    router.add_argument("--fleet-host", default=None, help="address of the fleet port (default: --host)")
    add_server_args(router, 8000)
    add_fleet_key_args(router)
    add_ledger_arg(router)
    add_test_faults_arg(router)
    router.set_defaults(func=cmd_router)

    drain = sub.add_parser("drain", help="drain a worker: it takes no new request, finishes those in flight, then "
                           "exits (as on SIGTERM)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    drain.add_argument("worker", metavar="[NAME@]HOST:PORT",
                       help="the worker's control endpoint; with --fleet-keys, NAME is its member")
    add_fleet_key_args(drain)
    drain.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the worker's answer")
    drain.set_defaults(func=cmd_drain)

    add_keys_command(sub)

    from kvseal.audit.__main__ import add_audit_args  # argparse only; the audit loads when it runs

    audit = sub.add_parser("audit", help="canary leak audit of any OpenAI-compatible server "
                           "(exit 0 clean, 1 violation, 2 could not run)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_audit_args(audit)
    audit.set_defaults(func=cmd_audit)

    from kvseal.doctor import add_doctor_args

    doctor = sub.add_parser("doctor", help="check a running fleet through its router: one row per node, agreement, "
                            "pools, reachability and a live probe of every pair (exit 0 healthy, 1 problems, 2 "
                            "unreachable)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_doctor_args(doctor)
    doctor.set_defaults(func=cmd_doctor)

    from kvseal.ledger.incidents import add_incidents_args

    incidents = sub.add_parser("incidents", help="from a forensic ledger: the responses computed from KV not "
                               "written for them, the tenants affected and the source (exit 0 none, 1 some, 2 "
                               "cannot read the ledger)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_incidents_args(incidents)
    incidents.set_defaults(func=cmd_incidents)

    from kvseal.bench.load.config import add_bench_args  # argparse only, like the audit's

    bench = sub.add_parser("bench", help="load generator and latency/throughput report for any OpenAI-compatible "
                           "server (exit 0 all completed, 1 some failed, 2 could not run)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(a, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(a.func(a))
    except ValueError as exc:  # configuration errors: name the field, the value and the fix
        print(f"kvseal: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""kvseal's command line: `kvseal serve [MODEL]` and friends, its parser (`--help` documents every flag); what each
command does is in kvseal/commands.py."""

from __future__ import annotations

import argparse
import logging
import sys

from kvseal.auth.options import add_fleet_key_args, add_keys_command, add_kv_channel_arg
from kvseal.commands import (
    cmd_audit,
    cmd_bench,
    cmd_doctor,
    cmd_drain,
    cmd_incidents,
    cmd_router,
    cmd_serve,
    cmd_worker,
)
from kvseal.config import LedgerConfig, ModelConfig, ServerConfig
from kvseal.config_args import add_config_args, add_engine_args
from kvseal.embed.config import EmbedConfig
from kvseal.metrics.token import add_metrics_token_arg


def add_log_level_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def add_fleet_port_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet-port", type=int, default=0,
                   help="port where workers started with --router HOST:PORT join (0: any free port; the one chosen "
                        "is in the log and in /info as fleet_endpoint)")
    p.add_argument("--fleet-host", default=None, help="address of the fleet port (default: --host)")


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch and the kernels in this process (default: `kvseal serve` splits the "
                        "cores among its workers; `kvseal serve --unified` uses every core for prompt chunks of "
                        "256 tokens or more and leaves one to the HTTP server on smaller steps)")


def add_kv_transport_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-transport", default="zmq", choices=["zmq", "nixl"],
                   help="how KV pages move from prefill to decode workers: zmq (ZeroMQ over TCP, a packed copy) or "
                        "nixl (NIXL over UCX: RDMA, shared memory or TCP; decode reads straight into its reserved "
                        "pages; pip install 'kvseal[nixl]'). Every worker of a fleet uses the same one")


def add_test_faults_arg(p: argparse.ArgumentParser) -> None:
    # test-only, absent from --help on purpose: kvseal/faults.py
    p.add_argument("--test-faults", default=None, help=argparse.SUPPRESS)


def add_server_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p, ServerConfig)
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="require a bearer key on every route but /health: FILE has one `TENANT KEY` line per key "
                        "(# comments), optionally followed by the tenant's settings: weight=W priority_class=N "
                        "max_concurrent=N rpm=N tpm=N kv_share=F (README: Tenants); the tenant keys the prefix "
                        "cache. `TENANT KEY admin` marks an admin key: only "
                        "those see the fleet's internals (/info's workers, /metrics, /doctor/probe); a tenant's "
                        "/info shows the model, the window and its own requests. Without it: no keys, one tenant, "
                        "everyone sees everything")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="render chats with the jinja2 template in FILE instead of the model's own (as vLLM's "
                        "--chat-template; /tokenize with messages uses it too)")
    add_log_level_arg(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvseal", description="A disaggregated LLM server with sealed KV.")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    for role in ("prefill", "decode"):
        _worker_parser(sub, role)
    _router_parser(sub)
    _drain_parser(sub)
    add_keys_command(sub)
    _tool_parsers(sub)
    return parser


def _command(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str,
             ) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvseal.ledger.store import default_path

    serve = _command(sub, "serve", "serve a model with the OpenAI API")
    add_engine_args(serve, ledger_default=default_path())
    add_threads_arg(serve)
    add_server_args(serve)
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
    add_fleet_port_args(serve)
    add_fleet_key_args(serve, serve=True)
    add_metrics_token_arg(serve, serve=True)
    add_kv_channel_arg(serve)
    add_kv_transport_arg(serve)
    add_config_args(serve, EmbedConfig)
    add_test_faults_arg(serve)
    serve.set_defaults(func=cmd_serve)


def _worker_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], role: str) -> None:
    w = _command(sub, role, f"run one {role} worker (for a cluster: one per host or GPU)")
    add_engine_args(w)
    add_threads_arg(w)
    w.add_argument("--host", default="127.0.0.1", help="address of the control socket")
    w.add_argument("--port", type=int, default=0, help="control port (0: any free port)")
    add_log_level_arg(w)
    w.add_argument("--router", default=None, metavar="[NAME@]HOST:PORT",
                   help="join a running router at its fleet endpoint (its --fleet-port); the router checks this "
                        "worker like one it started with (seal 7) and exits it with the reason if not. With "
                        "--fleet-keys, NAME is the router's member (default: router), whose key the join pins")
    add_fleet_key_args(w)
    w.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus /metrics on this port of --host (0: any free port, shown in the log and "
                        "in /info as metrics_endpoint; -1: none)")
    add_metrics_token_arg(w)
    w.add_argument("--advertise-host", default=None,
                   help="the address others connect to: the router's to the control port, and for a decode worker "
                        "prefill's to the KV port (default: --host and --kv-host; give the host's name or address "
                        "when they bind 0.0.0.0, as in a pod)")
    w.add_argument("--drain-timeout", type=float, default=600.0,
                   help="on SIGTERM or `kvseal drain`, seconds to finish the requests in flight before the rest "
                        "fail")
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


def _router_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    router = _command(sub, "router", "serve the OpenAI API in front of prefill and decode workers")
    # the model for its tokenizer, the window to serve (default: the workers' model window) and the model id
    add_config_args(router, ModelConfig, only=("path", "max_model_len", "served_name"))
    router.add_argument("--prefill", action="append", default=[], metavar="[NAME@]HOST:PORT",
                        help="a prefill worker's control endpoint (repeatable); with --fleet-keys, NAME is its "
                             "member (default: prefill), whose key the router pins")
    router.add_argument("--decode", action="append", default=[], metavar="[NAME@]HOST:PORT",
                        help="a decode worker's control endpoint (repeatable); NAME as for --prefill (default: "
                             "decode)")
    add_fleet_port_args(router)
    add_server_args(router)
    add_fleet_key_args(router)
    add_config_args(router, LedgerConfig)
    add_test_faults_arg(router)
    router.set_defaults(func=cmd_router)


def _drain_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    drain = _command(sub, "drain", "drain a worker: it takes no new request, finishes those in flight, then exits "
                     "(as on SIGTERM)")
    drain.add_argument("worker", metavar="[NAME@]HOST:PORT",
                       help="the worker's control endpoint; with --fleet-keys, NAME is its member")
    add_fleet_key_args(drain)
    drain.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the worker's answer")
    drain.set_defaults(func=cmd_drain)


def _tool_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """audit, doctor, incidents and bench: each module owns its flags (argparse only; it loads when it runs)."""
    from kvseal.audit.__main__ import add_audit_args
    from kvseal.bench.load.config import add_bench_args
    from kvseal.doctor import add_doctor_args
    from kvseal.ledger.incidents import add_incidents_args

    tools = {
        "audit": ("canary leak audit of any OpenAI-compatible server (exit 0 clean, 1 violation, 2 could not run)",
                  add_audit_args, cmd_audit),
        "doctor": (("check a running fleet through its router: one row per node, agreement, pools, reachability and "
                   "a live probe of every pair (exit 0 healthy, 1 problems, 2 unreachable)"), add_doctor_args,
                   cmd_doctor),
        "incidents": (("from a forensic ledger: the responses computed from KV not written for them, the tenants "
                      "affected and the source (exit 0 none, 1 some, 2 cannot read the ledger)"), add_incidents_args,
                      cmd_incidents),
        "bench": (("load generator and latency/throughput report for any OpenAI-compatible server (exit 0 all "
                  "completed, 1 some failed, 2 could not run)"), add_bench_args, cmd_bench),
    }
    for name, (help, add, func) in tools.items():
        p = _command(sub, name, help)
        add(p)
        p.set_defaults(func=func)


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

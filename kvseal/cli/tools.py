"""audit, doctor, incidents and bench: tools for any OpenAI-compatible server or a ledger. Each module owns its
flags (argparse only; it loads when it runs)."""

from __future__ import annotations

import argparse

from kvseal.cli.base import Subparsers, command


def add_parsers(sub: Subparsers[argparse.ArgumentParser]) -> None:
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
        p = command(sub, name, help)
        add(p)
        p.set_defaults(func=func)


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

"""`kvseal audit URL --tenant-keys KEY_A,KEY_B`: does this server keep two API keys' tenants apart?

Runs the probes in kvseal/audit/tenant_probes/, in this order (the noisy neighbour last: it leaves the server
busy), each judging one shared resource held, broken or not_applicable with its evidence:
  prefix_cache       a cache hit across keys, by cached_tokens and by timing, with a same-key control
  stored_responses   /v1/responses stored by A: GET, continue, DELETE as B
  status_pages       what /metrics, /info (and /slots) show B about A
  noisy_neighbour    B's time to first token alone and under A's flood
Exit 1 if any probe is broken, else 2 if any could not run, else 0. Keys are never printed or written: the
report names the tenants A and B, and every string in it passes through `redact`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import httpx

from kvseal.audit.tenant_probes import noisy_neighbour, prefix_cache, status_pages, stored_responses
from kvseal.audit.tenant_probes.common import ProbeConfig, ProbeContext, ProbeError, error_message, redact

Probe = Callable[[ProbeContext], Awaitable[dict[str, Any]]]
PROBES: dict[str, Probe] = {prefix_cache.NAME: prefix_cache.run, stored_responses.NAME: stored_responses.run,
                            status_pages.NAME: status_pages.run, noisy_neighbour.NAME: noisy_neighbour.run}


def parse_keys(arg: str) -> tuple[str, str] | None:
    keys = [k.strip() for k in arg.split(",")]
    if len(keys) != 2 or not all(keys) or keys[0] == keys[1]:
        return None
    return keys[0], keys[1]


def parse_probes(arg: str | None) -> tuple[str, ...] | None:
    """The probes named (in the audit's own order); None when one is unknown."""
    if arg is None:
        return tuple(PROBES)
    names = {n.strip().replace("-", "_") for n in arg.split(",") if n.strip()}
    return tuple(n for n in PROBES if n in names) if names and names <= set(PROBES) else None


def exit_code(verdicts: list[str]) -> int:
    return 1 if "broken" in verdicts else 2 if "error" in verdicts else 0


async def audit(base: str, model: str | None, keys: tuple[str, str], config: ProbeConfig, probes: tuple[str, ...],
                seed: int) -> dict[str, Any]:
    from kvseal.audit.runner import AuditSetupError, discover, make_client

    for name in ("httpx", "httpcore"):  # `kvseal` logs at INFO; a line per request would drown the table
        logging.getLogger(name).setLevel(logging.WARNING)
    started, t0, rng = datetime.now(UTC).isoformat(timespec="seconds"), time.monotonic(), random.Random(seed)
    salts = {t: f"tenant-{t.lower()}-{rng.getrandbits(64):016x}" for t in ("A", "B")} \
        if config.cache_salt_per_key else None
    report: dict[str, Any] = {"audit": "tenant isolation", "target": base, "started": started, "seed": seed,
                              "run": secrets.token_hex(4),
                              "config": {**asdict(config), "probes": list(probes)}}
    async with make_client(base, config.timeout, 4, None) as client:
        client.headers["Authorization"] = f"Bearer {keys[0]}"
        try:
            found, window, _ = await discover(client, model, min(config.timeout, 60.0))
        except AuditSetupError as exc:
            return redact({**report, "verdict": "COULD NOT RUN", "exit_code": 2, "error": str(exc), "probes": []},
                          {"A": keys[0], "B": keys[1]})
        del client.headers["Authorization"]
        ctx = ProbeContext(client, {"A": keys[0], "B": keys[1]}, found, window, rng, config, report["run"], salts)
        refused, report["unknown_key_status"] = await preflight(ctx)
        if refused:
            return redact({**report, "model": found, "verdict": "COULD NOT RUN", "exit_code": 2, "error": refused,
                           "probes": []}, ctx.keys)
        results = []
        for name in probes:
            print(f"kvseal audit: tenant probe {name} ...", file=sys.stderr, flush=True)
            try:
                results.append(await PROBES[name](ctx))
            except (ProbeError, httpx.HTTPError) as exc:
                results.append({"probe": name, "verdict": "error", "summary": f"could not run: {exc!r}",
                                "evidence": {}})
    code = exit_code([r["verdict"] for r in results])
    report.update(model=found, context_window=window, duration_s=time.monotonic() - t0, probes=results,
                  verdict={0: "HELD", 1: "BROKEN", 2: "INCOMPLETE"}[code], exit_code=code)
    return redact(report, ctx.keys)


async def preflight(ctx: ProbeContext) -> tuple[str | None, int]:
    """(why a tenant's key cannot be audited or None, the status a made-up key gets). Both keys must complete a
    one-token request: a refused key would otherwise read as a tenant kept apart by every probe."""
    body = {"model": ctx.model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    for t in ("A", "B"):
        r = await ctx.client.post("/v1/completions", json=body, headers=ctx.auth(t))
        if r.status_code != 200:
            return f"tenant {t}'s key cannot complete a request: {r.status_code} {error_message(r)}", 0
    made_up = f"sk-kvseal-audit-{ctx.rng.getrandbits(64):016x}"
    r = await ctx.client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {made_up}"})
    return None, r.status_code


def render(report: dict[str, Any]) -> str:
    lines = [f"kvseal audit --tenant-keys of {report['target']}  model {report.get('model')}"]
    if report.get("unknown_key_status") == 200:
        lines.append("note: the server answered a made-up key too: it has no keys, so A and B are anyone")
    lines.append("")
    for p in report["probes"]:
        lines.append(f"{p['probe']:<18} {p['verdict']:<15} {p['summary']}")
    trials = next((p["evidence"].get("trials") for p in report["probes"] if p["probe"] == prefix_cache.NAME), None)
    if trials:
        lines += ["", "prefix_cache trial | A first (s) | B copy (s) | B fresh (s) | A again (s) | B copy cached"]
        for i, t in enumerate(trials, 1):
            cached = t["b_copy_cached"] if t["b_copy_cached"] is not None else "-"
            lines.append(f"{i} | {t['a_first_s']:.3f} | {t['b_copy_s']:.3f} | {t['b_fresh_s']:.3f} | "
                         f"{t['a_again_s']:.3f} | {cached}")
    if "error" in report:
        lines.append(f"could not run: {report['error']}")
    lines += ["", f"verdict: {report['verdict']} (exit {report['exit_code']})"]
    return "\n".join(lines)


def run_tenant_audit(base: str, model: str | None, keys_arg: str, probes_arg: str | None, config: ProbeConfig,
                     seed: int, report_path: str) -> int:
    from kvseal.audit.report import write_json

    keys = parse_keys(keys_arg)
    if keys is None:
        print("kvseal audit: --tenant-keys takes two different keys, KEY_A,KEY_B", file=sys.stderr)
        return 2
    probes = parse_probes(probes_arg)
    if probes is None:
        print(f"kvseal audit: --probes takes a comma-separated list of {', '.join(PROBES)}", file=sys.stderr)
        return 2
    report = asyncio.run(audit(base, model, keys, config, probes, seed))
    write_json(report, report_path)
    print(render(report))
    print(f"report: {report_path}")
    return int(report["exit_code"])

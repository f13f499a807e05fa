"""`kvseal doctor ROUTER_URL`: one row per node, then the checks an operator would make by hand.

Rows: role and liveness, pool tokens against the served window, fingerprint, page size, KV dtype, layout,
kernels/arithmetic, test faults, free and cached pages, requests in flight; then each tenant's share of the tokens
served against its share of the weights. Checks: every node agrees and every
pool holds the window, every worker is reachable and serving, no test faults, no NIXL read past its deadline still
keeping pages out of a pool (decode) or an export window (prefill), and a live probe (one greedy request
through every (prefill, decode) pair, `POST /doctor/probe`) gives the same tokens on every pair.

Exit 0: healthy. 1: each problem printed with its fix. 2: the router cannot be reached (or refuses the key).
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from typing import Any

import httpx

from kvseal.wire.kvspec import KVSpec
from kvseal.wire.roles import Role

# what the serving nodes must agree on, by their /info names: the KV spec's fields, kernels, arithmetic, tokenizer.
# Read from /info's JSON with .get: doctor reads any router or unified server (of any version), whose nodes may
# never have answered (no card fields at all); what is missing is shown as unknown, never defaulted into a check.
AGREE = (*KVSpec.__struct_fields__, "kernels", "arithmetic", "tokenizer_digest")


@dataclass(frozen=True)
class Problem:
    what: str
    fix: str


@dataclass(frozen=True)
class Probe:
    prefill: str | None
    decode: str | None
    tokens: tuple[int, ...] = ()
    error: str | None = None
    seconds: float = 0.0


def nodes(info: dict[str, Any]) -> list[dict[str, Any]]:
    """The workers of a router's /info, or the one unified engine."""
    if info.get("role") == Role.UNIFIED:
        return [{**info, "endpoint": "(in the router process)", "state": "serving", "alive": True}]
    return list(info.get("workers", []))


def serving_pairs(info: dict[str, Any]) -> list[tuple[str, str]]:
    if info.get("role") == Role.UNIFIED:
        return []
    ws = [w for w in nodes(info) if w.get("state") == "serving"]
    prefills = [p for p in ws if p["role"] == Role.PREFILL]
    return [(p["endpoint"], d["endpoint"]) for p in prefills for d in ws if d["role"] == Role.DECODE]


def assess(info: dict[str, Any], probes: list[Probe]) -> list[Problem]:
    """Every problem of the fleet described by a router's (or unified server's) /info and the probes' results."""
    out: list[Problem] = []
    window = int(info.get("context_window") or 0)
    ws = nodes(info)
    for w in ws:
        name, state = f"{w['role']} {w['endpoint']}", w.get("state")
        if state == "refused":
            out.append(Problem(f"{name} failed the fleet check and gets no request: {w.get('reason')}",
                               "restart it with the settings the reason names (or stop it)"))
        elif state in ("lost", "connecting") or not w.get("alive"):
            out.append(Problem(f"{name} is not reachable ({state}); requests sent to it failed",
                               f"restart it on the same address, or start a replacement with `kvseal {w['role']} "
                               f"--router HOST:{'FLEET_PORT'}` and stop this one"))
        elif state == "draining":
            out.append(Problem(f"{name} is draining: it takes no new request", "wait for it to leave, and start a "
                               "replacement if its role needs the capacity"))
        out += _stuck_reads(name, w)
        pool = w.get("pool_tokens")
        if pool is not None and window and int(pool) < window:
            out.append(Problem(f"{name} holds {pool} KV tokens, less than the {window}-token served window",
                               f"restart it with --kv-pool-tokens {window} or more, or lower the router's "
                               f"--max-model-len to {pool}"))
    for role in ("prefill", "decode") if info.get("role") != Role.UNIFIED else ():
        if not any(w["role"] == role and w.get("state") == "serving" for w in ws):
            out.append(Problem(f"no {role} worker is serving: every request gets 503 no_worker",
                               f"start a {role} worker (`kvseal {role} --router HOST:FLEET_PORT`)"))
    serving = [w for w in ws if w.get("state") == "serving"]
    for field in AGREE:
        values = {str(w.get(field)) for w in serving if w.get(field) is not None}
        if field == "tokenizer_digest" and info.get("tokenizer_digest"):
            values.add(str(info["tokenizer_digest"]))
        if len(values) > 1:
            out.append(Problem(f"serving workers disagree on {field}: " + ", ".join(
                f"{w['role']} {w['endpoint']}={w.get(field)}" for w in serving),
                f"restart the odd ones with the fleet's {field}"))
    faults = {f"{w['role']} {w['endpoint']}": w.get("test_faults") for w in ws if w.get("test_faults")}
    if info.get("test_faults"):
        faults["router"] = info["test_faults"]
    if faults:
        out.append(Problem("test-only faults are on: " + ", ".join(f"{k} ({v})" for k, v in faults.items()),
                           "restart every process without --test-faults: this fleet is broken on purpose"))
    reference: Probe | None = None
    for p in probes:
        pair = f"prefill {p.prefill} -> decode {p.decode}" if p.prefill else "the server"
        if p.error is not None:
            out.append(Problem(f"probe through {pair} failed: {p.error}",
                               "read that worker's log and /info; restart it if it does not recover"))
        elif reference is None:
            reference = p
        elif p.tokens != reference.tokens:
            out.append(Problem(f"probe through {pair} answered {list(p.tokens)}, but prefill {reference.prefill} "
                               f"-> decode {reference.decode} answered {list(reference.tokens)}: greedy tokens must "
                               "be equal on every pair", "compare the pairs' kernels, arithmetic and weights "
                               "(/info); take the odd worker out (kvseal drain) and restart it"))
    return out


def _stuck_reads(name: str, w: dict[str, Any]) -> list[Problem]:
    """NIXL reads past their deadline keep pages out of a pool until NIXL says they are over (never on a timer)."""
    out = []
    reads, pages = int(w.get("kv_reads_overdue") or 0), int(w.get("kv_read_pages_overdue") or 0)
    if reads:
        out.append(Problem(f"{name} keeps {pages} KV page(s) out of its pool for {reads} NIXL read(s) past their "
                           "deadline: their requests ended, but a read still running could land bytes in them",
                           "check the KV link to the prefill workers (the read ends when it completes or UCX reports "
                           "the link down); restarting this decode worker (kvseal drain) also ends them"))
    held = int(w.get("kv_export_pages_overdue") or 0)
    if held:
        out.append(Problem(f"{name} keeps {held} export window page(s) for NIXL offers that no decode worker has "
                           "answered within the transfer timeout: a read of them may still be running",
                           "check the decode workers and the KV links; the pages are freed at decode's answer, "
                           "or when this prefill worker restarts"))
    return out


def table(url: str, info: dict[str, Any]) -> str:
    window = int(info.get("context_window") or 0)
    head = ("node", "role", "state", "pool/window", "fingerprint", "page", "kv dtype", "layout", "kernels/arith",
            "faults", "free/cached", "inflight")
    rows = [("router " + url, "router", "up", f"-/{window}", "-", "-", "-", "-", "-", info.get("test_faults") or "-",
             "-", str(info.get("live_requests", "-")))] if info.get("role") != Role.UNIFIED else []
    for w in nodes(info):
        pool = w.get("pool_tokens")
        ok = "ok" if pool is not None and int(pool) >= window else "SHORT"
        rows.append((str(w["endpoint"]), str(w["role"]), str(w.get("state")), f"{pool}/{window} {ok}",
                     str(w.get("model_fingerprint", "?"))[:15], str(w.get("page_size")), str(w.get("kv_dtype")),
                     str(w.get("kv_layout", "?")).split(":")[0], f"{w.get('kernels')}/{w.get('arithmetic')}",
                     w.get("test_faults") or "-", f"{w.get('free_pages')}/{w.get('cached_pages')}",
                     str(w.get("inflight", w.get("running", "-")))))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(n) for c, n in zip(r, widths)).rstrip() for r in [head, *rows])


def tenant_table(info: dict[str, Any]) -> str | None:
    """Each tenant's share of the tokens the engines served (summed over every worker) against its share of the
    weights: the fairness the operator asked for next to what it got (shares differ when a tenant asked for less
    than its share; the scheduler evens them out only while tenants wait). None when no engine served anyone."""
    books: dict[str, dict[str, float]] = {}
    for w in nodes(info):
        for tenant, f in (w.get("tenants") or {}).items():
            b = books.setdefault(tenant, {"tokens": 0.0, "weight": float(f.get("weight", 1.0)), "queue_s": 0.0,
                                          "scheduled": 0.0, "kv_pages": 0.0})
            b["tokens"] += float(f.get("prefill_tokens", 0)) + float(f.get("decode_tokens", 0))
            b["queue_s"] += float(f.get("queue_seconds", 0.0))
            b["scheduled"] += float(f.get("scheduled", 0))
            b["kv_pages"] += float(f.get("kv_pages", 0))
    total, weights = sum(b["tokens"] for b in books.values()), sum(b["weight"] for b in books.values())
    if not books or total == 0:
        return None
    head = ("tenant", "weight", "weight share", "tokens served", "token share", "mean queue", "kv pages now")
    rows = [(t or '""', f"{b['weight']:g}", f"{b['weight'] / weights:.3f}", f"{b['tokens']:.0f}",
             f"{b['tokens'] / total:.3f}", f"{b['queue_s'] / max(b['scheduled'], 1) * 1e3:.0f} ms",
             f"{b['kv_pages']:.0f}") for t, b in sorted(books.items())]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(n) for c, n in zip(r, widths)).rstrip() for r in [head, *rows])


def probe(client: httpx.Client, url: str, pair: tuple[str, str] | None) -> Probe:
    params = {"prefill": pair[0], "decode": pair[1]} if pair else {}
    p, d = pair or (None, None)
    try:
        r = client.post(url + "/doctor/probe", params=params)
    except httpx.HTTPError as exc:
        return Probe(p, d, error=f"{type(exc).__name__}: {exc}")
    if r.status_code != 200:
        try:
            err = r.json()["error"]
            why = f"{r.status_code} {err.get('code')}: {err.get('message')}"
        except (ValueError, KeyError, TypeError):
            why = f"{r.status_code}: {r.text[:200]}"
        return Probe(p, d, error=why)
    body = r.json()
    return Probe(p, d, tokens=tuple(body["tokens"]), seconds=float(body["seconds"]))


def add_doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", metavar="ROUTER_URL", help="the router (or `kvseal serve`) base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None, help="a key from the router's --api-keys file, if it has one")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for /info and for each probe")
    p.add_argument("--no-probe", action="store_true", help="skip the live probe through every pair")


def run_doctor(a: argparse.Namespace) -> int:
    url = a.url.rstrip("/")
    headers = {"authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe is ours to print
    with httpx.Client(timeout=a.timeout, headers=headers) as client:
        try:
            r = client.get(url + "/info")
            r.raise_for_status()
            info = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            print(f"kvseal doctor: cannot read {url}/info: {exc}", file=sys.stderr)
            return 2
        if "role" not in info:  # a tenant's view (tenancy/tenantview.py): no fleet to check
            print(f"kvseal doctor: {url}/info shows this key only its own requests: give an admin key (a "
                  f"`TENANT KEY admin` line of the router's --api-keys file) with --api-key", file=sys.stderr)
            return 2
        print(f"kvseal doctor {url}: {info.get('role')}, model {info.get('model') or info.get('served_model_name')}"
              f", window {info.get('context_window')} tokens")
        print(table(url, info))
        shares = tenant_table(info)
        if shares is not None:
            print(shares)
        pairs: list[tuple[str, str] | None] = list(serving_pairs(info)) or ([None] if info.get("role") == Role.UNIFIED
                                                                            else [])
        probes = [] if a.no_probe else [probe(client, url, pair) for pair in pairs]
    for p in probes:
        pair = f"prefill {p.prefill} -> decode {p.decode}" if p.prefill else "unified engine"
        print(f"probe {pair}: " + (f"FAILED {p.error}" if p.error else
                                   f"{len(p.tokens)} tokens in {p.seconds:.2f}s {list(p.tokens)}"))
    problems = assess(info, probes)
    if not problems:
        print(f"healthy: {len(nodes(info))} worker(s) agree and hold the window, all reachable, "
              f"{len(probes)} probe(s) equal")
        return 0
    print(f"{len(problems)} problem(s):")
    for i, pr in enumerate(problems, 1):
        print(f"  {i}. {pr.what}\n     fix: {pr.fix}")
    return 1

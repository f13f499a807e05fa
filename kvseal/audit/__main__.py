"""`kvseal audit URL` (also `python -m kvseal.audit URL`): a black-box canary leak audit of any
OpenAI-compatible server (kvseal, vLLM, SGLang, llama.cpp server).

Exit codes: 0 clean, 1 at least one violation, 2 the audit could not run or finished too little to judge.
This module imports only argparse at import time, so `kvseal --help` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time
from datetime import UTC, datetime
from urllib.parse import urlsplit


def add_audit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="base URL of the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine); "
                               "only this address is contacted")
    p.add_argument("--model", default=None, help="model id to audit (when not given: the first one in /v1/models)")
    p.add_argument("--context-window", type=int, default=None,
                   help="context window in tokens (when not given: max_model_len, context_length or "
                        "context_window from /v1/models; required when the server advertises none)")
    p.add_argument("--requests", type=int, default=200, help="in-window canary requests under load")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    p.add_argument("--over-window", type=int, default=10, metavar="K",
                   help="prompts above the window (1.3x and 2x), each must get a 4xx")
    p.add_argument("--consistency-prompts", type=int, default=8,
                   help="fixed greedy prompts sent alone first, then again under load")
    p.add_argument("--max-tokens", type=int, default=24, help="max_tokens of every request")
    p.add_argument("--no-stream", action="store_true", help="send only non-streamed requests")
    p.add_argument("--strict", action="store_true",
                   help="count greedy answers that change under load as violations")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--max-duration", type=float, default=1800.0,
                   help="seconds for the whole audit; unfinished requests are then cancelled")
    p.add_argument("--min-completed", type=float, default=0.5,
                   help="fraction of requests that must be answered for a verdict (else exit 2)")
    p.add_argument("--report", default="audit_report.json", help="where to write the JSON report")
    p.add_argument("--seed", type=int, default=None,
                   help="seed for secrets and prompts (random when not given; the report records it)")
    p.add_argument("--api-key", default=None, help="bearer token to send (the server's API key)")
    t = p.add_argument_group("across tenants (instead of the canary audit)")
    t.add_argument("--tenant-keys", default=None, metavar="KEY_A,KEY_B",
                   help="audit tenant isolation between two API keys (docs/audit-tenants.md): a prefix cache, stored "
                        "responses, status pages and latency shared across keys; each probe is held, broken or "
                        "not_applicable (exit 1 if any is broken, 2 if one could not run). Keys are never printed")
    t.add_argument("--probes", default=None, metavar="NAME,...",
                   help="only these tenant probes: prefix_cache, stored_responses, status_pages, noisy_neighbour "
                        "(default: all)")
    t.add_argument("--probe-trials", type=int, default=6, help="prefix cache: trials (each a fresh pair of prompts)")
    t.add_argument("--probe-chars", type=int, default=3000,
                   help="prefix cache: characters per prompt (about a quarter as many tokens; keep it inside the "
                        "window)")
    t.add_argument("--cache-salt-per-key", action="store_true",
                   help="prefix cache: each tenant sends a cache_salt of its own (vLLM's way to keep tenants apart)")
    t.add_argument("--noisy-samples", type=int, default=20,
                   help="noisy neighbour: tenant B's one-token chats, alone and again under tenant A's flood")
    t.add_argument("--flood-concurrency", type=int, default=8, help="noisy neighbour: tenant A's requests in flight")
    t.add_argument("--flood-chars", type=int, default=50_000,
                   help="noisy neighbour: characters of each of tenant A's /tokenize bodies")
    t.add_argument("--flood-chat-chars", type=int, default=4000,
                   help="noisy neighbour: characters of each of tenant A's chats (at most half the window)")
    t.add_argument("--flood-max-seconds", type=float, default=120.0,
                   help="noisy neighbour: B's sampling under the flood ends after this long (or once one sample "
                        "settles the verdict)")
    t.add_argument("--status-paths", default="/metrics,/info,/slots",
                   help="status pages tenant B reads for traces of tenant A")


def base_url(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    path = parts.path.rstrip("/")
    path = path.removesuffix("/v1")
    return f"{parts.scheme}://{parts.netloc}{path}"


def _check_args(a: argparse.Namespace) -> str | None:
    for name in ("requests", "concurrency", "max_tokens"):
        if getattr(a, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    for name in ("over_window", "consistency_prompts"):
        if getattr(a, name) < 0:
            return f"--{name.replace('_', '-')} must not be negative"
    if a.timeout <= 0 or a.max_duration <= 0:
        return "--timeout and --max-duration must be positive"
    if not 0.0 <= a.min_completed <= 1.0:
        return "--min-completed must be between 0 and 1"
    return None


async def _audit(a: argparse.Namespace, base: str) -> int:
    from kvseal.audit.canary import CHAT_OVERHEAD_TOKENS, build_plan, sizing_from_calibration
    from kvseal.audit.report import build_report, render, write_json
    from kvseal.audit.runner import AuditSetupError, calibrate, discover, make_client, run_phase

    for name in ("httpx", "httpcore"):  # `kvseal` sets INFO logging; one line per request would drown the table
        logging.getLogger(name).setLevel(logging.WARNING)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(2**31)
    started, t0 = datetime.now(UTC).isoformat(timespec="seconds"), time.monotonic()
    deadline = t0 + a.max_duration
    async with make_client(base, a.timeout, a.concurrency, a.api_key) as client:
        try:
            model, advertised, source = await discover(client, a.model, min(a.timeout, a.max_duration))
        except AuditSetupError as exc:
            print(f"kvseal audit: {exc}", file=sys.stderr)
            return 2
        window = a.context_window or advertised
        source = "--context-window" if a.context_window else source
        if window is None:
            print(f"kvseal audit: {base}/v1/models advertises no context window for {model!r}; "
                  "pass --context-window", file=sys.stderr)
            return 2
        if window < a.max_tokens + CHAT_OVERHEAD_TOKENS + 32:
            print(f"kvseal audit: context window {window} is too small for --max-tokens {a.max_tokens}",
                  file=sys.stderr)
            return 2
        cpt, cal_secret = await calibrate(client, model, window,
                                          max(min(a.timeout, deadline - time.monotonic()), 0.1))
        sizing = sizing_from_calibration(window, a.max_tokens, cpt)
        solo, load = build_plan(a.requests, a.over_window, a.consistency_prompts, window, a.max_tokens,
                                not a.no_stream, random.Random(seed))
        secrets = {s.secret: s.index for s in solo + load if s.secret}
        secrets[cal_secret] = -1
        print(f"kvseal audit: {model} at {base}, window {window} ({source}), "
              f"{cpt or 0:.2f} chars/token{'' if cpt else ' (uncalibrated)'}, seed {seed}: "
              f"{len(solo)} alone, then {len(load)} at concurrency {a.concurrency}", file=sys.stderr)
        results = await run_phase(client, solo, sizing, model, seed, a.timeout, 1, deadline, "alone")
        results += await run_phase(client, load, sizing, model, seed, a.timeout, a.concurrency, deadline, "load")
    meta = {"target": base, "model": model, "context_window": window, "window_source": source,
            "advertised_window": advertised, "started": started, "duration_s": time.monotonic() - t0,
            "seed": seed, "chars_per_token": cpt, "calibrated": cpt is not None,
            "sizing": {"fit_chars_per_token": sizing.fit_cpt, "over_chars_per_token": sizing.over_cpt,
                       "usable_prompt_tokens": sizing.usable},
            "config": {k: getattr(a, k) for k in ("requests", "concurrency", "over_window", "consistency_prompts",
                                                  "max_tokens", "no_stream", "strict", "timeout", "max_duration",
                                                  "min_completed")}}
    report = build_report(results, secrets, a.strict, meta, len(solo) + len(load), a.min_completed)
    write_json(report, a.report)
    print(render(report))
    print(f"report: {a.report}")
    return int(report["exit_code"])


def _tenant_audit(a: argparse.Namespace, base: str) -> int:
    from kvseal.audit.tenant_probes.common import ProbeConfig
    from kvseal.audit.tenants import run_tenant_audit

    if a.probe_trials < 2 or a.probe_chars < 100 or a.noisy_samples < 2 or a.flood_concurrency < 1 \
            or min(a.flood_chars, a.flood_chat_chars) < 100 or a.flood_max_seconds <= 0:
        print("kvseal audit: --probe-trials and --noisy-samples must be at least 2, --flood-concurrency at least 1, "
              "--probe-chars, --flood-chars and --flood-chat-chars at least 100, --flood-max-seconds positive",
              file=sys.stderr)
        return 2
    paths = tuple(p.strip() for p in a.status_paths.split(",") if p.strip())
    if not paths or not all(p.startswith("/") for p in paths):
        print("kvseal audit: --status-paths takes paths that start with /, e.g. /metrics,/info", file=sys.stderr)
        return 2
    config = ProbeConfig(trials=a.probe_trials, prompt_chars=a.probe_chars, cache_salt_per_key=a.cache_salt_per_key,
                         noisy_samples=a.noisy_samples, flood_concurrency=a.flood_concurrency,
                         flood_chars=a.flood_chars, flood_chat_chars=a.flood_chat_chars,
                         flood_max_s=a.flood_max_seconds, status_paths=paths,
                         timeout=a.timeout)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(2**31)
    return run_tenant_audit(base, a.model, a.tenant_keys, a.probes, config, seed, a.report)


def run_audit(a: argparse.Namespace) -> int:
    problem = _check_args(a)
    try:
        base = base_url(a.url)
    except ValueError as exc:
        problem = str(exc)
    if problem:
        print(f"kvseal audit: {problem}", file=sys.stderr)
        return 2
    if a.tenant_keys is not None:
        return _tenant_audit(a, base)
    try:
        return asyncio.run(_audit(a, base))
    except KeyboardInterrupt:
        print("kvseal audit: interrupted", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvseal audit", description=__doc__.splitlines()[0] if __doc__ else None,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_audit_args(p)
    return run_audit(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""`kvseal audit URL --tenant-keys KEY_A,KEY_B`: a timing probe for a prefix cache shared across tenants.

Per trial, with a fresh long prompt P and a fresh prompt F of the same length:
  1. tenant A sends P (its KV may now be cached);
  2. tenant B sends P and F, in alternating order across trials, and each answer's time is taken;
  3. tenant A sends P again: the control, how much a same-tenant cache hit saves on this server.
If B's copy of P is served clearly faster than B's fresh F, B was served A's cache: the cache is shared across
tenants (exit 1). Keys are never printed or written; the report names the tenants A and B.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvseal.audit.canary import filler

SHARED_RATIO = 0.8  # B's copy in at most this fraction of B's fresh time (median) ...
SHARED_FRACTION = 0.8  # ... and faster in at least this fraction of the trials: shared


@dataclass
class Trial:
    a_first_s: float
    b_copy_s: float
    b_fresh_s: float
    a_again_s: float
    b_copy_cached: int | None  # usage.prompt_tokens_details.cached_tokens, when the server reports it
    a_again_cached: int | None


def prompt_text(chars: int, rng: random.Random) -> str:
    """About `chars` of prose that starts unlike any other probe prompt (so no two share a first page)."""
    return f"Case {rng.randrange(10**12):012d}. " + filler(chars, None, rng)


async def timed(client: httpx.AsyncClient, key: str, model: str, prompt: str) -> tuple[float, int | None]:
    """Seconds for a one-token completion (the prefill, essentially), and the reported cached tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    elapsed = time.perf_counter() - t0
    if r.status_code != 200:
        raise ProbeError(f"a probe request answered {r.status_code}: {_error_message(r)}")
    details = (r.json().get("usage") or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return elapsed, cached if isinstance(cached, int) else None


class ProbeError(Exception):
    pass


def _error_message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


async def run_trials(client: httpx.AsyncClient, keys: tuple[str, str], model: str, chars: int, trials: int,
                     rng: random.Random) -> list[Trial]:
    key_a, key_b = keys
    await timed(client, key_a, model, prompt_text(chars, rng))  # warm-up: first-request costs stay out
    out = []
    for i in range(trials):
        p, f = prompt_text(chars, rng), prompt_text(chars, rng)
        a_first, _ = await timed(client, key_a, model, p)
        if i % 2 == 0:
            b_copy, b_cached = await timed(client, key_b, model, p)
            b_fresh, _ = await timed(client, key_b, model, f)
        else:
            b_fresh, _ = await timed(client, key_b, model, f)
            b_copy, b_cached = await timed(client, key_b, model, p)
        a_again, a_cached = await timed(client, key_a, model, p)
        out.append(Trial(a_first, b_copy, b_fresh, a_again, b_cached, a_cached))
    return out


def verdict(trials: list[Trial]) -> dict[str, Any]:
    copy = statistics.median(t.b_copy_s for t in trials)
    fresh = statistics.median(t.b_fresh_s for t in trials)
    control = statistics.median(t.a_again_s / t.a_first_s for t in trials)
    faster = sum(t.b_copy_s < t.b_fresh_s for t in trials) / len(trials)
    reported = [t.b_copy_cached for t in trials if t.b_copy_cached is not None]
    shared = (copy <= SHARED_RATIO * fresh and faster >= SHARED_FRACTION) or any(n > 0 for n in reported)
    if shared:
        text = (f"SHARED: tenant B's copy of tenant A's prompt took {copy / fresh:.2f}x the time of a fresh prompt "
                f"(faster in {faster:.0%} of trials"
                f"{', and the server reported cached tokens' if any(reported) else ''})"
                f": one tenant can tell what another sent")
    elif control <= SHARED_RATIO:
        text = (f"ISOLATED: tenant A's own repeat took {control:.2f}x (its cache works) but tenant B's copy took "
                f"{copy / fresh:.2f}x of a fresh prompt: no cache is shared across tenants")
    else:
        text = (f"NO CACHE SEEN: neither tenant's repeat was faster (A {control:.2f}x, B {copy / fresh:.2f}x); "
                f"nothing shared is visible, but nothing cached either")
    return {"shared": shared, "b_copy_over_fresh": copy / fresh, "b_copy_faster_fraction": faster,
            "a_repeat_over_first": control, "summary": text}


async def probe(base: str, model: str | None, keys: tuple[str, str], chars: int, trials: int, timeout: float,
                seed: int) -> tuple[int, dict[str, Any]]:
    import logging

    from kvseal.audit.runner import AuditSetupError, discover, make_client

    for name in ("httpx", "httpcore"):  # `kvseal` logs at INFO; a line per request would drown the table
        logging.getLogger(name).setLevel(logging.WARNING)
    async with make_client(base, timeout, 2, None) as client:
        client.headers["Authorization"] = f"Bearer {keys[0]}"
        try:
            model, _, _ = await discover(client, model, min(timeout, 60.0))
            del client.headers["Authorization"]
            results = await run_trials(client, keys, model, chars, trials, random.Random(seed))
        except (AuditSetupError, ProbeError, httpx.HTTPError) as exc:
            print(f"kvseal audit: the tenant probe could not run: {exc}", file=sys.stderr)
            return 2, {}
    v = verdict(results)
    report = {"probe": "cross-tenant prefix cache timing", "target": base, "model": model, "prompt_chars": chars,
              "seed": seed, "trials": [t.__dict__ for t in results], **v}
    return (1 if v["shared"] else 0), report


def render(report: dict[str, Any]) -> str:
    rows = ["trial | A first (s) | B copy (s) | B fresh (s) | A again (s) | B copy cached tokens",
            "---|---|---|---|---|---"]
    for i, t in enumerate(report["trials"], 1):
        rows.append(f"{i} | {t['a_first_s']:.3f} | {t['b_copy_s']:.3f} | {t['b_fresh_s']:.3f} | "
                    f"{t['a_again_s']:.3f} | {t['b_copy_cached'] if t['b_copy_cached'] is not None else '—'}")
    return "\n".join(rows) + "\n\n" + str(report["summary"])


def run_probe(base: str, model: str | None, keys_arg: str, chars: int, trials: int, timeout: float,
              seed: int, report_path: str) -> int:
    from kvseal.audit.report import write_json

    keys = tuple(k.strip() for k in keys_arg.split(","))
    if len(keys) != 2 or not all(keys) or keys[0] == keys[1]:
        print("kvseal audit: --tenant-keys takes two different keys, KEY_A,KEY_B", file=sys.stderr)
        return 2
    code, report = asyncio.run(probe(base, model, (keys[0], keys[1]), chars, trials, timeout, seed))
    if report:
        write_json(report, report_path)
        print(render(report))
        print(f"report: {report_path}")
    return code

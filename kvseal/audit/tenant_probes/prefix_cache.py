"""Probe: is the prefix cache shared across tenants? (by usage's cached_tokens and by timing)

Per trial, with a fresh long prompt P and a fresh prompt F of the same length:
  1. tenant A sends P (its KV may now be cached);
  2. tenant B sends P and F, in alternating order across trials, and each answer's time is taken;
  3. tenant A sends P again: the same-key control, which must hit for the probe to mean anything.
B's copy of P reported as cached, or served clearly faster than B's fresh F: broken (B can tell what A sent).
Otherwise held, but only if A's own repeat hit; a server whose cache never hits (off, or not observable) is
not_applicable, never held. With --cache-salt-per-key each tenant sends its own constant cache_salt (vLLM's way
of keeping tenants apart in one cache).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from kvseal.audit.canary import filler
from kvseal.audit.tenant_probes.common import (
    ProbeContext,
    ProbeError,
    Verdict,
    error_message,
    json_of,
    result,
    timed_post,
)

NAME = "prefix_cache"
HIT_RATIO = 0.8  # a repeat in at most this fraction of the comparison time (median) ...
HIT_FRACTION = 0.8  # ... and faster in at least this fraction of the trials: a timing hit
# A cache shared with B serves B's copy as fast as A's own repeat, so when A's control hits, B's copy must also
# save at least half of what A's repeat saved (ratio <= (1 + A's ratio) / 2) to count: a busy machine's noise
# alone then rarely reads as a hit.


@dataclass
class Trial:
    a_first_s: float
    b_copy_s: float
    b_fresh_s: float
    a_again_s: float
    b_copy_cached: int | None  # usage.prompt_tokens_details.cached_tokens, when the server reports it
    a_again_cached: int | None


def prompt_text(chars: int, rng: random.Random, run: str) -> str:
    """About `chars` of prose that starts unlike any other probe prompt, of this run or an earlier one with the
    same seed (so no two share a first page, and a server's warm cache never serves a 'first' send)."""
    return f"Case {run}-{rng.randrange(10**12):012d}. " + filler(chars, None, rng)


async def timed(ctx: ProbeContext, tenant: str, prompt: str) -> tuple[float, int | None]:
    """Seconds for a one-token completion (the prefill, essentially), and the reported cached tokens."""
    body = {"model": ctx.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **ctx.extra(tenant)}
    r, elapsed = await timed_post(ctx, tenant, "/v1/completions", body)
    if r.status_code != 200:
        raise ProbeError(f"tenant {tenant}'s completion answered {r.status_code}: {error_message(r)}")
    details = (json_of(r).get("usage") or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return elapsed, cached if isinstance(cached, int) else None


async def run_trials(ctx: ProbeContext) -> list[Trial]:
    chars, rng = ctx.config.prompt_chars, ctx.rng
    await timed(ctx, "A", prompt_text(chars, rng, ctx.run))  # warm-up: first-request costs stay out
    out = []
    for i in range(ctx.config.trials):
        p, f = prompt_text(chars, rng, ctx.run), prompt_text(chars, rng, ctx.run)
        a_first, _ = await timed(ctx, "A", p)
        if i % 2 == 0:
            b_copy, b_cached = await timed(ctx, "B", p)
            b_fresh, _ = await timed(ctx, "B", f)
        else:
            b_fresh, _ = await timed(ctx, "B", f)
            b_copy, b_cached = await timed(ctx, "B", p)
        a_again, a_cached = await timed(ctx, "A", p)
        out.append(Trial(a_first, b_copy, b_fresh, a_again, b_cached, a_cached))
    return out


def judge(trials: list[Trial]) -> tuple[Verdict, str, dict[str, Any]]:
    """(verdict, summary, figures) from the trials (pure)."""
    copy = statistics.median(t.b_copy_s for t in trials)
    fresh = statistics.median(t.b_fresh_s for t in trials)
    control = statistics.median(t.a_again_s / t.a_first_s for t in trials)
    b_faster = sum(t.b_copy_s < t.b_fresh_s for t in trials) / len(trials)
    a_faster = sum(t.a_again_s < t.a_first_s for t in trials) / len(trials)
    b_reported = [t.b_copy_cached for t in trials if t.b_copy_cached is not None]
    a_reported = [t.a_again_cached for t in trials if t.a_again_cached is not None]
    b_cached_hit = any(n > 0 for n in b_reported)
    control_hit = any(n > 0 for n in a_reported) or (control <= HIT_RATIO and a_faster >= HIT_FRACTION)
    b_ratio_bound = min(HIT_RATIO, (1 + control) / 2) if control_hit else HIT_RATIO
    b_timing_hit = copy <= b_ratio_bound * fresh and b_faster >= HIT_FRACTION
    figures = {"b_copy_over_fresh": copy / fresh, "b_copy_faster_fraction": b_faster,
               "a_repeat_over_first": control, "a_repeat_faster_fraction": a_faster,
               "b_copy_cached_tokens": b_reported, "a_repeat_cached_tokens": a_reported,
               "control_hit": control_hit, "cross_hit_by_cached_tokens": b_cached_hit,
               "cross_hit_by_timing": b_timing_hit,
               "thresholds": {"hit_ratio": HIT_RATIO, "hit_fraction": HIT_FRACTION,
                              "b_copy_over_fresh_bound": b_ratio_bound}}
    if b_cached_hit or b_timing_hit:
        how = ", and the server reported cached tokens for it" if b_cached_hit else ""
        return "broken", (f"SHARED: tenant B's copy of tenant A's prompt took {copy / fresh:.2f}x the time of a "
                          f"fresh prompt (faster in {b_faster:.0%} of trials{how}): one tenant can tell what "
                          f"another sent"), figures
    if control_hit:
        return "held", (f"ISOLATED: tenant A's own repeat took {control:.2f}x (its cache works) but tenant B's "
                        f"copy took {copy / fresh:.2f}x of a fresh prompt and no cached tokens: no cache is "
                        f"shared across tenants"), figures
    return "not_applicable", (f"NO CACHE SEEN: neither tenant's repeat hit (A {control:.2f}x, B "
                              f"{copy / fresh:.2f}x, no cached tokens reported): nothing shared is visible, but "
                              f"nothing cached either"), figures


async def run(ctx: ProbeContext) -> dict[str, Any]:
    trials = await run_trials(ctx)
    verdict, summary, figures = judge(trials)
    return result(NAME, verdict, summary, prompt_chars=ctx.config.prompt_chars,
                  cache_salt_per_key=ctx.salts is not None, trials=[asdict(t) for t in trials], **figures)

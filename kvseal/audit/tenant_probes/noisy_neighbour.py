"""Probe: does tenant A's flood slow tenant B down? (B's time to first token, alone and under A's flood)

B sends `noisy_samples` one-token chats one after another, alone; then tenant A floods (`flood_concurrency`
requests in flight on a connection pool of its own, alternating /tokenize bodies of `flood_chars` characters
and chats of `flood_chat_chars`, at most half the window) while B sends the same number again. A one-token
chat's latency is B's time to first token. Broken: any of B's requests under the flood failed, or B's p99 under
the flood exceeded max(SLOWDOWN_FACTOR x B's p99 alone, B's p99 alone + SLOWDOWN_ADD_S). Both bounds are in the
evidence. Sampling under the flood ends early once the verdict is settled or after `flood_max_s` (the evidence
says which).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from kvseal.audit.canary import filler
from kvseal.audit.report import quantile
from kvseal.audit.runner import make_client
from kvseal.audit.tenant_probes.common import ProbeContext, ProbeError, Verdict, error_message, json_of, result

NAME = "noisy_neighbour"
SLOWDOWN_FACTOR = 2.0
SLOWDOWN_ADD_S = 1.0
FLOOD_WARMUP_S = 0.5  # A's flood runs this long before B's first sample under it


@dataclass
class Sample:
    latency_s: float
    status: int | None  # None: no HTTP answer (timeout, connection error)
    error: str | None = None


async def one_token(ctx: ProbeContext, i: int) -> Sample:
    body = {"model": ctx.model, "messages": [{"role": "user", "content": f"Say hello to visitor {i}."}],
            "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    try:
        r = await ctx.client.post("/v1/chat/completions", json=body, headers=ctx.auth("B"))
    except httpx.HTTPError as exc:
        return Sample(time.perf_counter() - t0, None, repr(exc)[:200])
    elapsed = time.perf_counter() - t0
    return Sample(elapsed, r.status_code, None if r.status_code == 200 else error_message(r))


async def b_samples(ctx: ProbeContext, start: int) -> list[Sample]:
    return [await one_token(ctx, start + i) for i in range(ctx.config.noisy_samples)]


async def b_flooded_samples(ctx: ProbeContext, start: int, bound: float) -> tuple[list[Sample], str | None]:
    """B's samples under the flood, and why they stopped before `noisy_samples` (None: they did not). They stop
    once the verdict is settled (a failure, or with at most 100 samples, where p99 is the maximum, one over
    `bound`) or after `flood_max_s`: a server that makes B wait a minute a request need not be asked 20 times."""
    deadline, out = time.monotonic() + ctx.config.flood_max_s, []
    for i in range(ctx.config.noisy_samples):
        s = await one_token(ctx, start + i)
        out.append(s)
        if s.status != 200:
            return out, "B's request failed"
        if s.latency_s > bound and ctx.config.noisy_samples <= 100:
            return out, f"B waited {s.latency_s:.3f} s, over the bound"
        if time.monotonic() > deadline and i + 1 < ctx.config.noisy_samples:
            return out, f"the flood ran {ctx.config.flood_max_s:.0f} s (--flood-max-seconds)"
    return out, None


def p99_bound(alone: list[Sample]) -> float:
    p99 = quantile([s.latency_s for s in alone], 0.99) or 0.0
    return max(SLOWDOWN_FACTOR * p99, p99 + SLOWDOWN_ADD_S)


def judge(alone: list[Sample], flooded: list[Sample]) -> tuple[Verdict, str, dict[str, Any]]:
    """(verdict, summary, figures) from B's samples (pure); every alone sample answered 200."""
    solo = [s.latency_s for s in alone]
    under = [s.latency_s for s in flooded if s.status == 200]
    failed = [s for s in flooded if s.status != 200]
    p50, p99 = quantile(solo, 0.5) or 0.0, quantile(solo, 0.99) or 0.0
    f50, f99 = quantile(under, 0.5), quantile(under, 0.99)
    bound = p99_bound(alone)
    figures = {"b_alone_s": [round(x, 4) for x in solo], "b_flooded_s": [round(s.latency_s, 4) for s in flooded],
               "b_alone_p50_s": p50, "b_alone_p99_s": p99, "b_flooded_p50_s": f50, "b_flooded_p99_s": f99,
               "b_flooded_errors": len(failed), "b_flooded_error_examples": [asdict(s) for s in failed[:5]],
               "p99_bound_s": bound, "thresholds": {"factor": SLOWDOWN_FACTOR, "add_s": SLOWDOWN_ADD_S}}
    head = f"tenant B's TTFT p50/p99 {p50:.3f}/{p99:.3f} s alone"
    if failed:
        return "broken", (f"{head}; under tenant A's flood {len(failed)} of {len(flooded)} of B's requests failed "
                          f"(first: {failed[0].status} {failed[0].error})"), figures
    assert f50 is not None and f99 is not None
    tail = f"{head}, {f50:.3f}/{f99:.3f} s under tenant A's flood (bound {bound:.3f} s)"
    return ("broken", f"{tail}: A's flood slows B down", figures) if f99 > bound else \
        ("held", f"{tail}: B kept its latency", figures)


async def tokenize_shape(ctx: ProbeContext) -> str | None:
    """The field /tokenize takes its text in ("prompt": vLLM and kvseal, "content": llama.cpp), None: no /tokenize."""
    for field in ("prompt", "content"):
        body = {"prompt": {"model": ctx.model, "prompt": "hello"}, "content": {"content": "hello"}}[field]
        r = await ctx.client.post("/tokenize", json=body, headers=ctx.auth("A"))
        if r.status_code == 200 and json_of(r).get("tokens"):  # llama.cpp answers {"prompt": ...} with no tokens
            return field
    return None


def flood_bodies(ctx: ProbeContext, field: str | None) -> list[tuple[str, dict[str, Any]]]:
    """(path, body) pairs A's flood cycles through."""
    chars, chat_chars = ctx.config.flood_chars, ctx.config.flood_chat_chars
    if ctx.window is not None:
        chat_chars = min(chat_chars, ctx.window * 2)  # at most about half the window at ~4 characters a token
    chat = ("/v1/chat/completions", {"model": ctx.model, "max_tokens": 16, "temperature": 0, "messages": [
        {"role": "user", "content": "Summarize: " + filler(chat_chars, None, ctx.rng)}]})
    if field is None:
        return [chat]
    text = filler(chars, None, ctx.rng)
    tokenize = ("/tokenize", {"model": ctx.model, "prompt": text} if field == "prompt" else {"content": text})
    return [tokenize, chat]


async def flood(ctx: ProbeContext, bodies: list[tuple[str, dict[str, Any]]], stop: asyncio.Event,
                tally: Counter[str]) -> None:
    """A's requests, `flood_concurrency` in flight, until `stop`; every answer counted as `path status`."""
    async with make_client(str(ctx.client.base_url), ctx.config.timeout, ctx.config.flood_concurrency, None) as c:
        async def worker(w: int) -> None:
            i = w
            while not stop.is_set():
                path, body = bodies[i % len(bodies)]
                if "messages" in body:  # a first page of its own: a cache never makes A's flood cheap
                    text = f"Request {ctx.run}-{w}-{i}. " + body["messages"][0]["content"]
                    body = {**body, "messages": [{"role": "user", "content": text}]}
                try:
                    r = await c.post(path, json=body, headers=ctx.auth("A"))
                    tally[f"{path} {r.status_code}"] += 1
                except httpx.HTTPError as exc:
                    tally[f"{path} {type(exc).__name__}"] += 1
                except asyncio.CancelledError:
                    tally[f"{path} still in flight at the end"] += 1
                    raise
                i += 1

        workers = [asyncio.create_task(worker(w)) for w in range(ctx.config.flood_concurrency)]
        await stop.wait()
        for t in workers:
            t.cancel()  # requests still in flight are dropped (their connections closed)
        await asyncio.gather(*workers, return_exceptions=True)


async def run(ctx: ProbeContext) -> dict[str, Any]:
    await one_token(ctx, -1)  # warm-up: first-request costs stay out
    alone = await b_samples(ctx, 0)
    if any(s.status != 200 for s in alone):
        bad = next(s for s in alone if s.status != 200)
        raise ProbeError(f"tenant B's one-token chat failed with no flood running: {bad.status} {bad.error}")
    field = await tokenize_shape(ctx)
    stop, tally = asyncio.Event(), Counter[str]()
    flooding = asyncio.create_task(flood(ctx, flood_bodies(ctx, field), stop, tally))
    await asyncio.sleep(FLOOD_WARMUP_S)
    try:
        flooded, stopped = await b_flooded_samples(ctx, len(alone), p99_bound(alone))
    finally:
        stop.set()
        await flooding
    if sum(n for k, n in tally.items() if k.endswith((" 401", " 403"))):
        raise ProbeError(f"tenant A's flood was refused as unauthorized: {dict(tally)}")
    verdict, summary, figures = judge(alone, flooded)
    return result(NAME, verdict, summary, samples=ctx.config.noisy_samples, b_flooded_taken=len(flooded),
                  stopped_early=stopped, flood_max_s=ctx.config.flood_max_s,
                  flood_concurrency=ctx.config.flood_concurrency, flood_chars=ctx.config.flood_chars,
                  flood_chat_chars=ctx.config.flood_chat_chars,
                  tokenize_field=field, a_flood_answers=dict(tally), **figures)

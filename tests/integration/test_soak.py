"""A bounded soak of the disaggregated server: many concurrent clients, mixed prompts, streamed and whole,
some hanging up mid-stream. Every request is accounted for, no 200 comes without a completion, memory does
not creep, and every worker ends at its baseline (seal 8).

Knobs (CI-friendly defaults; scripts/soak.sh runs the same test longer):
    KVSEAL_SOAK_CLIENTS   concurrent clients                                        (default 256)
    KVSEAL_SOAK_SECONDS   how long clients keep starting new requests               (default 30)
    KVSEAL_SOAK_REQUESTS  most requests in all (0: no cap, the duration decides)    (default 0)
    KVSEAL_SOAK_SEED      seed of the request mix                                   (default 0)
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil
import pytest

from tests.helpers.procs import Server, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.e2e]
MODEL = "SmolLM2-135M-Instruct"
WINDOW = 1024
CLIENTS = int(os.environ.get("KVSEAL_SOAK_CLIENTS", "256"))
SECONDS = float(os.environ.get("KVSEAL_SOAK_SECONDS", "30"))
MAX_REQUESTS = int(os.environ.get("KVSEAL_SOAK_REQUESTS", "0"))
SEED = int(os.environ.get("KVSEAL_SOAK_SEED", "0"))
# A request started before the deadline must end within this (it may queue behind hundreds of others).
DRAIN_S = float(os.environ.get("KVSEAL_SOAK_DRAIN_SECONDS", "420"))
MEMORY_GROWTH = 0.30


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(["--max-model-len", str(WINDOW), "--kv-pool-tokens", "4096", "--log-level", "warning"])
    try:
        yield s.ready(300)
    finally:
        s.stop()


def rss_bytes(pid: int) -> int:
    """Resident memory of the server process and every worker it started."""
    root = psutil.Process(pid)
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


# -- the request mix ---------------------------------------------------------------------------------------
LONG = " ".join(f"Item {i} costs {i * 7 % 100} coins and weighs {i % 13} kilograms." for i in range(40))
# (prompt, weight): chat-templated they are about 30, 40, 70, 310 and 620 tokens
PROMPTS = [("Hi", 3), ("What is the capital of France?", 3), ("Write a haiku about the sea.", 3),
           ("Explain in one sentence what a CPU cache is. " * 4, 2), (LONG[:900], 1), (LONG, 1)]


@dataclass
class Job:
    chat: bool
    stream: bool
    hang_up: bool  # close the connection after the first chunk
    body: dict[str, Any]


def make_job(rng: random.Random) -> Job:
    chat, stream = rng.random() < 0.5, rng.random() < 0.6
    text = rng.choices([p for p, _ in PROMPTS], [w for _, w in PROMPTS])[0]
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(4, 16),
                            "temperature": rng.choice([0.0, 0.0, 0.7, 1.0]), "seed": rng.randint(0, 2**31),
                            "ignore_eos": rng.random() < 0.5}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return Job(chat, stream, stream and rng.random() < 0.2, body)


# -- outcomes ----------------------------------------------------------------------------------------------
@dataclass
class Tally:
    started: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)  # "ok", "aborted", "error <status>"
    problems: list[str] = field(default_factory=list)  # anything that breaks the contract

    def bad(self, job: Job, what: str) -> None:
        self.outcomes["bad"] += 1
        if len(self.problems) < 20:
            self.problems.append(f"{what} (request {json.dumps(job.body)[:160]})")


def check_error_body(status: int, raw: bytes) -> str | None:
    """None when raw is an OpenAI-shaped error, else what is wrong with it."""
    try:
        err = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return f"{status} with a body that is not an OpenAI error: {raw[:200]!r}"
    if not (isinstance(err.get("message"), str) and isinstance(err.get("type"), str)):
        return f"{status} with a malformed error: {err}"
    return None


def check_usage(u: Any, job: Job) -> str | None:
    if not isinstance(u, dict):
        return f"no usage: {u!r}"
    p, c, t = u.get("prompt_tokens"), u.get("completion_tokens"), u.get("total_tokens")
    if not (isinstance(p, int) and isinstance(c, int) and p > 0 and 1 <= c <= job.body["max_tokens"]
            and t == p + c):
        return f"bad usage {u}"
    if job.body["ignore_eos"] and c != job.body["max_tokens"]:
        return f"ignore_eos but {c} of {job.body['max_tokens']} tokens"
    return None


async def run_whole(http: httpx.AsyncClient, job: Job, tally: Tally) -> None:
    path = "/v1/chat/completions" if job.chat else "/v1/completions"
    r = await http.post(path, json=job.body)
    if r.status_code != 200:
        tally.outcomes[f"error {r.status_code}"] += 1
        why = check_error_body(r.status_code, r.content)
        if why or r.status_code != 503:
            tally.bad(job, why or f"unexpected error status {r.status_code}: {r.text[:200]}")
        return
    obj = r.json()
    ch = obj["choices"][0]
    text = ch["message"]["content"] if job.chat else ch["text"]
    why = None
    if ch.get("finish_reason") not in ("stop", "length") or not isinstance(text, str):
        why = f"200 without a completion: {obj}"
    why = why or check_usage(obj.get("usage"), job)
    if why:
        tally.bad(job, why)
    else:
        tally.outcomes["ok"] += 1


async def run_stream(http: httpx.AsyncClient, job: Job, tally: Tally) -> None:
    path = "/v1/chat/completions" if job.chat else "/v1/completions"
    async with http.stream("POST", path, json=job.body) as r:
        if r.status_code != 200:
            raw = await r.aread()
            tally.outcomes[f"error {r.status_code}"] += 1
            why = check_error_body(r.status_code, raw)
            if why or r.status_code != 503:
                tally.bad(job, why or f"unexpected error status {r.status_code}: {raw[:200]!r}")
            return
        events: list[str] = []
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line.removeprefix("data: "))
            if job.hang_up:
                tally.outcomes["aborted"] += 1
                return  # leaving the block closes the connection mid-stream
    if not events or events[-1] != "[DONE]":
        tally.bad(job, f"a 200 stream that did not end with [DONE]: {events[-2:]}")
        return
    objs = [json.loads(e) for e in events[:-1]]
    errors = [o for o in objs if "error" in o]
    finishes = [c["finish_reason"] for o in objs for c in o.get("choices", []) if c.get("finish_reason")]
    why = None
    if errors:
        why = f"error event in a 200 stream: {errors[0]}"
    elif len(finishes) != 1 or finishes[0] not in ("stop", "length"):
        why = f"stream finish reasons {finishes}"
    why = why or check_usage(objs[-1].get("usage") if objs else None, job)
    if why:
        tally.bad(job, why)
    else:
        tally.outcomes["ok"] += 1


async def client(i: int, http: httpx.AsyncClient, deadline: float, tally: Tally) -> None:
    rng = random.Random(SEED * 100_003 + i)
    await asyncio.sleep(rng.random() * 2.0)  # clients arrive over two seconds, not in one burst
    while time.monotonic() < deadline and (MAX_REQUESTS == 0 or tally.started < MAX_REQUESTS):
        job = make_job(rng)
        tally.started += 1
        try:
            await (run_stream if job.stream else run_whole)(http, job, tally)
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            tally.bad(job, f"{type(exc).__name__}: {exc}")


def server_warnings(server: Server, n: int = 30) -> str:
    lines = [x for x in server.output().splitlines()
             if " WARNING " in x or " ERROR " in x or "Traceback" in x or "Exception" in x]
    return "\n".join([f"server warnings and errors (last {n}):", *lines[-n:]])


def worker_baseline(url: str) -> bool | list[dict[str, Any]]:
    info = httpx.get(url + "/info", timeout=30).json()
    ok = info["live_requests"] == 0 and all(
        w["alive"] and w["free_pages"] == w["pool_pages"] and w["running"] == 0 and w["waiting"] == 0
        and w.get("reservations", 0) == 0 and w["inflight"] == 0 for w in info["workers"])
    return ok or info["workers"]


async def soak(server: Server) -> tuple[Tally, dict[str, int], float]:
    tally = Tally()
    # No keep-alive: a pooled connection that the server closes as idle just as a client reuses it fails with
    # a ReadError that says nothing about the server; a fresh connection per request cannot race like that.
    limits = httpx.Limits(max_connections=CLIENTS + 16, max_keepalive_connections=0)
    timeout = httpx.Timeout(DRAIN_S, connect=60.0)
    start = time.monotonic()
    deadline = start + SECONDS
    rss: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=timeout) as http:
        tasks = [asyncio.create_task(client(i, http, deadline, tally)) for i in range(CLIENTS)]
        await asyncio.sleep(SECONDS / 2)
        rss["middle"] = rss_bytes(server.p.pid)
        done, pending = await asyncio.wait(tasks, timeout=SECONDS / 2 + DRAIN_S)
        for t in pending:
            t.cancel()
        assert not pending, f"{len(pending)} of {CLIENTS} clients still busy {DRAIN_S:g}s after the deadline"
        for t in done:
            if t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    return tally, rss, time.monotonic() - start


def test_soak(server: Server) -> None:
    ended_before = httpx.get(server.url + "/info", timeout=30).json()["ended"]
    httpx.post(server.url + "/v1/completions", timeout=120,  # warm up before the memory baseline
               json={"model": MODEL, "prompt": LONG, "max_tokens": 4}).raise_for_status()
    tally, rss, took = asyncio.run(soak(server))
    wait_until(lambda: worker_baseline(server.url) is True, 60, "every worker back at its baseline")
    rss["end"] = rss_bytes(server.p.pid)
    info = httpx.get(server.url + "/info", timeout=30).json()
    ended = {k: v - ended_before.get(k, 0) for k, v in info["ended"].items()}
    o = tally.outcomes
    errors = " ".join(f"{k.split()[1]}={v}" for k, v in sorted(o.items()) if k.startswith("error"))
    print(f"\nsoak: {CLIENTS} clients, {took:.0f}s, requests={tally.started} ok={o['ok']} "
          f"errors[{errors or 'none'}] aborted={o['aborted']} bad={o['bad']} server_ended={ended} "
          f"rss_mb middle={rss['middle'] >> 20} end={rss['end'] >> 20}")
    if o["bad"]:
        print(server_warnings(server))

    assert not tally.problems, "\n".join([*tally.problems, server_warnings(server)])
    accounted = o["ok"] + o["aborted"] + sum(v for k, v in o.items() if k.startswith("error"))
    assert accounted == tally.started, (tally.started, o)  # none lost
    refused = sum(v for k, v in o.items() if k.startswith("error"))  # only 503s get this far
    assert o["ok"] > 0 and o["ok"] >= tally.started // 10, f"too few requests completed: {o}"
    assert o["aborted"] > 0, "the mix hangs up on some streams"
    # the server saw every request end exactly once (the warm-up too): each 503 as refused (the router records
    # an overload before the handoff as failed, the decode engine as rejected), each completion as finished,
    # each hang-up as aborted, or as finished when the last token beat the hang-up
    assert sum(ended.values()) == tally.started + 1, (ended, tally.started)
    assert ended["rejected"] + ended["failed"] == refused, (ended, o)
    assert ended["finished"] + ended["aborted"] == o["ok"] + o["aborted"] + 1, (ended, o)
    assert ended["finished"] >= o["ok"] + 1, (ended, o)
    assert rss["end"] <= rss["middle"] * (1 + MEMORY_GROWTH), rss

"""What the shared tenant state costs (issue 34): the same router with its limits in memory and in Redis, one run.

    python -m benchmarks.state_cost                  # bundled model, a few thousand tiny requests per mode

Per mode, a fresh `kvseal serve --unified` (the bundled model) with a tenant that has limits (rpm and tpm high
enough never to refuse, max_concurrent), so every request goes through admit, charge and release:
- TTFT of a 1-token chat, streamed, one at a time (--ttft-n): its p50 and p99;
- throughput of tiny requests (/tokenize of one word) from --concurrency clients (--tiny-n in all): requests/s.
Modes alternate (memory, redis, memory, redis, ... --rounds) and medians are reported with their ratio; Redis
is a real redis-server on loopback. Added TTFT target: at most 1 ms at the p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import ServerProc
from benchmarks.fairness import cpu_model

KEY = "sk-bench-state"


async def ttft(c: httpx.AsyncClient, model: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with c.stream("POST", "/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True,
                "temperature": 0}) as r:
            assert r.status_code == 200, await r.aread()
            first = None
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter() - t0
            assert first is not None
            out.append(first)
    return out


async def tiny(c: httpx.AsyncClient, n: int, concurrency: int) -> float:
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            r = await c.post("/tokenize", json={"prompt": "hello"})
            assert r.status_code == 200, r.text

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - t0)


def calls(redis_args: list[str], n: int) -> dict[str, float]:
    """The state calls alone, in this process: admit + charge (what a request waits for before a worker sees it)
    and release, each timed, Redis against memory: the direct measure of what Redis adds to a TTFT."""
    from kvseal.config import ServerConfig, TenantPolicy
    from kvseal.tenancy.state import TenantState, build_state

    policies = {"t": TenantPolicy(rpm=10**6, tpm=10**8, max_concurrent=1000)}
    out = {}
    for mode, extra in (("memory", {}), ("redis", dict(zip(("state", "state_password_file", "state_secret_file"),
                                                          redis_args[1::2], strict=True)))):
        state = build_state(ServerConfig(**extra), policies)  # type: ignore[arg-type]

        async def run(state: TenantState = state) -> list[float]:
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                lease = await state.limits.admit("t")
                await state.limits.charge(lease, 10, 1)
                times.append(time.perf_counter() - t0)
                await state.limits.release(lease)
            closing = state.close()
            if closing is not None:
                await closing
            return times

        out[mode] = statistics.median(asyncio.run(run())) * 1000
    return out


def one(mode: str, a: argparse.Namespace, tmp: Path, redis_args: list[str]) -> dict[str, Any]:
    server = ServerProc(["--unified", "--api-keys", str(tmp / "keys"), *(redis_args if mode == "redis" else [])])
    try:
        server.wait_ready(600)

        async def run() -> dict[str, Any]:
            async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                                         timeout=60, limits=httpx.Limits(max_connections=a.concurrency)) as c:
                model = (await c.get("/v1/models")).json()["data"][0]["id"]
                await ttft(c, model, 5)  # warm-up
                t = await ttft(c, model, a.ttft_n)
                rps = await tiny(c, a.tiny_n, a.concurrency)
            return {"ttft_p50_ms": statistics.median(t) * 1000, "ttft_p99_ms": sorted(t)[int(0.99 * len(t))] * 1000,
                    "tiny_rps": rps}

        return asyncio.run(run())
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ttft-n", type=int, default=100)
    p.add_argument("--tiny-n", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--calls", type=int, default=2000, help="admit + charge pairs timed in-process per mode")
    p.add_argument("--out", default="bench_out/state_cost.json")
    a = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.helpers.redis_server import RedisServer

    tmp = Path(tempfile.mkdtemp(prefix="kvseal-state-"))
    (tmp / "keys").write_text(f"t {KEY} rpm=1000000 tpm=100000000 max_concurrent=1000\n")
    (tmp / "secret").write_bytes(os.urandom(32).hex().encode())
    redis = RedisServer()
    redis_args = ["--state", redis.url, "--state-password-file", str(redis.password_file),
                  "--state-secret-file", str(tmp / "secret")]
    runs: dict[str, list[dict[str, Any]]] = {"memory": [], "redis": []}
    try:
        direct = calls(redis_args, a.calls)
        for _ in range(a.rounds):
            for mode in ("memory", "redis"):
                runs[mode].append(one(mode, a, tmp, redis_args))
                print(mode, runs[mode][-1], flush=True)
    finally:
        redis.close()
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    res = {"cpu": cpu_model(), "runs": runs, "median": med, "admit_charge_ms": direct,
           "ttft_p50_added_ms": med["redis"]["ttft_p50_ms"] - med["memory"]["ttft_p50_ms"],
           "tiny_rps_ratio": med["redis"]["tiny_rps"] / med["memory"]["tiny_rps"]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(f"CPU: {res['cpu']}; {a.rounds} rounds alternated, medians")
    print("| state | TTFT p50 | TTFT p99 | tiny requests/s |\n|---|---|---|---|")
    for m in ("memory", "redis"):
        print(f"| {m} | {med[m]['ttft_p50_ms']:.2f} ms | {med[m]['ttft_p99_ms']:.2f} ms | {med[m]['tiny_rps']:.0f} |")
    print(f"admit + charge, in-process medians: memory {direct['memory']:.3f} ms, Redis {direct['redis']:.3f} ms "
          f"(what Redis adds before a request reaches a worker: {direct['redis'] - direct['memory']:.3f} ms)")
    print(f"Redis adds {res['ttft_p50_added_ms']:.2f} ms to the TTFT p50 (target <= 1 ms); tiny requests "
          f"{res['tiny_rps_ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

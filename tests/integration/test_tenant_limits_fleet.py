"""Per-tenant limits on a disaggregated fleet (router + prefill + decode processes on loopback):

- eve (max_concurrent=2) keeps 16 requests going at once, each retried when `retry-after-ms` says (as the openai
  client does): most get 429, and bob, without limits, is not slowed by what she asks beyond her limit: the median
  latency of his requests meanwhile stays within 2x of his median while eve runs exactly two (the limit keeps her
  load on the workers at two requests, and a refusal costs the router little; generous bound, medians, no absolute
  time). His median alone is printed too: against it, eve's two admitted requests count, which share the engine
  by right (on a loaded 2-core host they made his requests several times slower);
- frank (rpm=5) used his minute's requests; after the decode worker is killed and restarted on its port, he still
  gets 429 while bob is served again: the limits live in the router, and a worker's restart resets nothing.
"""

from __future__ import annotations

import asyncio
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.fleet import LoopbackFleet, running
from tests.helpers.procs import Worker, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.serial]  # serial: measures time (scripts/test.sh)
MODEL = "SmolLM2-135M-Instruct"
KEYS = {"bob": "sk-bob-fleetlim-0001", "eve": "sk-eve-fleetlim-0002", "frank": "sk-frank-fleetlim-0003"}
ARGS = ["--max-model-len", "512", "--kv-pool-tokens", "2048"]
RPM = 5


class Fleet(LoopbackFleet):
    def __init__(self, keys: Path) -> None:
        super().__init__(ARGS, router=["--api-keys", str(keys)])

    def restart_decode(self) -> None:
        old = self.decode
        old.stop(signal.SIGKILL)
        new = Worker("decode", [*ARGS, "--port", str(old.port)])
        new.port, new.endpoint = old.port, old.endpoint
        self.decode = new.ready()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"bob {KEYS['bob']}\neve {KEYS['eve']} max_concurrent=2\nfrank {KEYS['frank']} rpm={RPM}\n")
    with running(lambda: Fleet(keys)) as f:
        yield f


async def ask(c: httpx.AsyncClient, tenant: str, max_tokens: int) -> tuple[int, float, httpx.Headers]:
    t0 = time.monotonic()
    r = await c.post("/v1/completions", headers={"Authorization": f"Bearer {KEYS[tenant]}"},
                     json={"model": MODEL, "prompt": f"{tenant}: count to twenty.", "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True})
    return r.status_code, time.monotonic() - t0, r.headers


async def bob_latencies(c: httpx.AsyncClient, n: int) -> list[float]:
    out = []
    for _ in range(n):
        status, took, headers = await ask(c, "bob", 16)
        assert status == 200 and "x-ratelimit-limit-requests" not in headers
        out.append(took)
    return out


def test_a_tenant_over_its_concurrency_gets_429_and_the_other_is_not_slowed(fleet: Fleet) -> None:
    codes: dict[int, list[int]] = {2: [], 16: []}

    async def run() -> dict[str, list[float]]:
        async with httpx.AsyncClient(base_url=fleet.router.url, timeout=300,
                                     limits=httpx.Limits(max_connections=100)) as c:
            await bob_latencies(c, 2)  # warm
            got = {"alone": await bob_latencies(c, 8)}
            for n in (2, 16):  # eve at her limit, then eve asking for eight times it
                stop = asyncio.Event()

                async def hammer(n: int = n, stop: asyncio.Event = stop) -> None:
                    while not stop.is_set():
                        status, _, headers = await ask(c, "eve", 48)
                        codes[n].append(status)
                        if status == 429:
                            await asyncio.sleep(max(0.2, int(headers["retry-after-ms"]) / 1000))

                eve = [asyncio.ensure_future(hammer()) for _ in range(n)]
                await asyncio.sleep(1.0)  # eve's two requests run (and, over her limit, the rest are refused)
                got[f"eve {n}"] = await bob_latencies(c, 8)
                stop.set()
                await asyncio.gather(*eve)
            return got

    lat = {k: statistics.median(v) for k, v in asyncio.run(run()).items()}
    print(f"bob's median latency: alone {lat['alone']:.3f}s, eve at her limit {lat['eve 2']:.3f}s, eve asking 8x "
          f"her limit {lat['eve 16']:.3f}s ({lat['eve 16'] / lat['eve 2']:.2f}x); eve over it: "
          f"{codes[16].count(200)} answered, {codes[16].count(429)} 429")
    # what eve asks beyond her limit costs bob nothing: refused at the router, it never reaches a worker
    assert lat["eve 16"] / lat["eve 2"] < 2.0, lat
    assert codes[16].count(429) > 16 and codes[16].count(200) >= 2 and set(codes[16]) == {200, 429}
    assert set(codes[2]) == {200}  # at her limit, never refused
    wait_until(fleet.at_baseline, 30, "both pools back to baseline")


def test_rate_limits_hold_across_a_worker_restart(fleet: Fleet) -> None:
    frank = httpx.Client(base_url=fleet.router.url, timeout=120, headers={"Authorization": f"Bearer {KEYS['frank']}"})
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    for _ in range(RPM):
        assert frank.post("/v1/completions", json=body).status_code == 200
    refused = frank.post("/v1/completions", json=body)
    assert refused.status_code == 429 and refused.headers["x-ratelimit-remaining-requests"] == "0"
    fleet.restart_decode()
    bob = {"Authorization": f"Bearer {KEYS['bob']}"}
    wait_until(lambda: httpx.post(fleet.router.url + "/v1/completions", json=body, headers=bob,
                                  timeout=60).status_code == 200, 60, "the fleet serving again after the restart")
    again = frank.post("/v1/completions", json=body)
    assert again.status_code == 429, again.text  # the restarted worker reset nothing: the router keeps the limits
    assert again.json()["error"]["code"] == "rate_limit_exceeded" and int(again.headers["retry-after"]) >= 1

"""Fair shares on a real server (one unified process on loopback, 4 batch slots), through HTTP:

- tenants a (weight=3) and b (weight=1) both keep more requests waiting than the batch holds; over the time both
  are backlogged, the engine serves a three times b's tokens, within 10% (read from the engine's per-tenant
  counters on /metrics, not from wall time);
- a tenant alone takes every batch slot (work-conserving), whatever its weight;
- a request's `priority` orders it among its own tenant's waiting requests (lower first);
- every request ends with its whole output, and the pool returns to its baseline (seal 8).

And on a disaggregated fleet (router + prefill + decode processes on loopback, as `kvseal serve` starts them): with
weights 3:1 and both tenants backlogged on the decode worker (8 batch slots), it serves a three times b's tokens,
within 10% (read from the decode worker's per-tenant figures in /info), and both pools return to baseline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from itertools import pairwise

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.fleet import LoopbackFleet, running
from tests.helpers.procs import Server, Worker, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.serial]  # serial: measures time (scripts/test.sh)
MODEL = "SmolLM2-135M-Instruct"
ADMIN = "sk-ops-fair-0003"
KEYS = {"a": "sk-a-fair-0001", "b": "sk-b-fair-0002"}
SLOTS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"a {KEYS['a']} weight=3\nb {KEYS['b']} weight=1\nops {ADMIN} admin\n")
    s = Server(["--unified", "--max-model-len", "256", "--kv-pool-tokens", "4096", "--max-num-seqs", str(SLOTS),
                "--api-keys", str(keys)])
    try:
        yield s.ready()
    finally:
        s.stop()


def tenants(server: Server) -> dict[str, dict[str, float]]:
    """tenant -> the engine's figures for it (tokens served, requests running and waiting)."""
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).text
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("kvseal:tenant_") and "tenant" in s.labels and s.labels.get("type") is None:
                out.setdefault(s.labels["tenant"], {})[s.name.removeprefix("kvseal:tenant_")] = s.value
    return out


def served(f: dict[str, dict[str, float]], t: str) -> float:
    return f[t]["prefill_tokens_total"] + f[t]["decode_tokens_total"]


async def flood(server: Server, counts: dict[str, int], max_tokens: int | Callable[[int], int]) -> list[int]:
    """Sends counts[t] requests of each tenant at once (request i asks for max_tokens, or max_tokens(i), tokens);
    the completion tokens of each answer."""
    length = max_tokens if callable(max_tokens) else lambda i: max_tokens
    async with httpx.AsyncClient(base_url=server.url, timeout=600,
                                 limits=httpx.Limits(max_connections=500)) as c:
        async def one(t: str, i: int) -> int:
            r = await c.post("/v1/completions", headers={"Authorization": f"Bearer {KEYS[t]}"},
                             json={"model": MODEL, "prompt": f"Request {i} of {t}: count.", "max_tokens": length(i),
                                   "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return int(r.json()["usage"]["completion_tokens"])

        return await asyncio.gather(*(one(t, i) for t, n in counts.items() for i in range(n)))


def test_weights_3_to_1_split_tokens_3_to_1_while_both_are_backlogged(server: Server) -> None:
    snaps: list[dict[str, dict[str, float]]] = []

    async def run() -> list[int]:
        task = asyncio.ensure_future(flood(server, {"a": 150, "b": 75}, max_tokens=8))
        while not task.done():
            f = await asyncio.to_thread(tenants, server)
            if all(f.get(t, {}).get("requests_waiting", 0) > 0 for t in ("a", "b")):
                snaps.append(f)
            await asyncio.wait({task}, timeout=0.2)
        return await task

    outputs = asyncio.run(run())
    assert outputs == [8] * 225  # every request got its whole output
    assert len(snaps) >= 2, "both tenants were never seen backlogged together"
    first, last = snaps[0], snaps[-1]
    a, b = served(last, "a") - served(first, "a"), served(last, "b") - served(first, "b")
    assert a + b > 1500  # a window of many admissions, not one batch's worth
    assert a / b == pytest.approx(3.0, rel=0.10), (a, b)
    print(f"tokens served while both backlogged: a {a:.0f}, b {b:.0f}, a/b {a / b:.3f}")
    wait_until(lambda: at_baseline(server), 30, "every page back in the pool")


def at_baseline(server: Server) -> bool:
    info = httpx.get(server.url + "/info", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).json()
    return bool(info["free_pages"] == info["pool_pages"] and not info["running"] and not info["waiting"])


def test_a_tenant_alone_takes_every_slot(server: Server) -> None:
    seen: list[float] = []

    async def run() -> list[int]:
        task = asyncio.ensure_future(flood(server, {"b": 3 * SLOTS}, max_tokens=24))
        while not task.done():
            f = await asyncio.to_thread(tenants, server)
            seen.append(f.get("b", {}).get("requests_running", 0))
            await asyncio.wait({task}, timeout=0.1)
        return await task

    assert asyncio.run(run()) == [24] * (3 * SLOTS)
    assert max(seen) == SLOTS  # b (weight 1, the smaller) alone fills the batch


def test_priority_orders_a_tenants_waiting_requests(server: Server) -> None:
    """With every slot taken, a's later request with priority -1 is served before its earlier one with priority 5."""
    order: list[str] = []

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as c:
            async def one(t: str, name: str, priority: int, max_tokens: int) -> None:
                r = await c.post("/v1/completions", headers={"Authorization": f"Bearer {KEYS[t]}"},
                                 json={"model": MODEL, "prompt": f"{name}: count.", "max_tokens": max_tokens,
                                       "temperature": 0, "ignore_eos": True, "priority": priority})
                assert r.status_code == 200, r.text
                order.append(name)

            async def until(cond: object) -> None:
                while not cond(await asyncio.to_thread(tenants, server)):  # type: ignore[operator]
                    await asyncio.sleep(0.05)

            # of different lengths: the slots free one at a time, 16 steps apart, so the two are admitted apart
            blockers = [asyncio.ensure_future(one("b", f"blocker{i}", 0, 48 + 16 * i)) for i in range(SLOTS)]
            await until(lambda f: f.get("b", {}).get("requests_running", 0) == SLOTS)
            late = asyncio.ensure_future(one("a", "priority 5", 5, 4))
            await until(lambda f: f.get("a", {}).get("requests_waiting", 0) == 1)
            early = asyncio.ensure_future(one("a", "priority -1", -1, 4))
            await until(lambda f: f.get("a", {}).get("requests_waiting", 0) == 2)
            await asyncio.gather(*blockers, late, early)

    asyncio.run(run())
    assert order.index("priority -1") < order.index("priority 5")


def worker_tenants(w: Worker) -> dict[str, dict[str, float]]:
    return w.info()["tenants"]  # type: ignore[no-any-return]


def length(i: int) -> int:
    """Request i's max_tokens in the disaggregated flood: 8, 16, 24, 32, 40, again."""
    return 8 + 8 * (i % 5)


def test_disaggregated_weights_3_to_1_split_tokens_3_to_1_while_both_are_backlogged(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"a {KEYS['a']} weight=3\nb {KEYS['b']} weight=1\n")
    args = ["--max-model-len", "256", "--kv-pool-tokens", "4096", "--max-num-seqs", str(2 * SLOTS)]
    with running(lambda: LoopbackFleet(args, router=["--api-keys", str(keys)])) as fleet:
        server = fleet.router
        snaps: list[tuple[bool, dict[str, dict[str, float]]]] = []  # (both backlogged, figures), every 0.1 s

        async def run() -> list[int]:
            # 3:1, so both end together; of five lengths, so the 8 slots free one at a time and each admission is
            # fairness's choice (requests of one length, admitted together, would end together: the slots would
            # change hands 8 at a time, and the ratio over the window would move by a whole batch's tokens)
            task = asyncio.ensure_future(flood(server, {"a": 60, "b": 20}, max_tokens=length))
            while not task.done():
                f = await asyncio.to_thread(worker_tenants, fleet.decode)
                snaps.append((all(f.get(t, {}).get("waiting", 0) > 0 for t in ("a", "b")), f))
                await asyncio.wait({task}, timeout=0.1)
            return await task

        outputs = asyncio.run(run())
        assert outputs == [length(i) for n in (60, 20) for i in range(n)]  # every request got its whole output
        # the tokens served between two readings that both saw each tenant with requests waiting for a slot
        a = b = 0.0
        for (both0, f0), (both1, f1) in pairwise(snaps):
            if both0 and both1:
                a += f1["a"]["decode_tokens"] - f0["a"]["decode_tokens"]
                b += f1["b"]["decode_tokens"] - f0["b"]["decode_tokens"]
        print(f"both backlogged in {sum(b for b, _ in snaps)} of {len(snaps)} readings")
        assert a + b > 1000, (a, b)  # most of the run (1,840 decode tokens), not one batch's worth
        assert a / b == pytest.approx(3.0, rel=0.10), (a, b)
        print(f"decode tokens served while both backlogged on the decode worker: a {a:.0f}, b {b:.0f}, "
              f"a/b {a / b:.3f}")
        wait_until(fleet.at_baseline, 30, "every page back in both pools")

"""The router's choice of worker under tenant fairness (router/pick.py): with --fairness vtc on the workers, a
request goes where its own tenant has the fewest requests in flight while another tenant competes; with off, or
one tenant alone, every serving worker stays a candidate. And the per-tenant counts the choice reads."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio

from kvseal.router.affinity import PrefixAffinity
from kvseal.router.pick import fair_candidates
from kvseal.router.workers import WorkerClient
from kvseal.wire.messages import GenerateRequest, SamplingParams


@dataclass
class W:
    endpoint: str
    tenant_inflight: Counter[str] = field(default_factory=Counter)
    fairness: str = "vtc"

    @property
    def inflight(self) -> int:
        return sum(self.tenant_inflight.values())


def test_a_light_tenant_goes_where_nothing_of_its_own_waits_even_behind_a_bigger_backlog() -> None:
    w1, w2 = W("w1", Counter(b=3)), W("w2", Counter(a=10))
    assert fair_candidates([w1, w2], "b") == [w2]  # 10 of A's ahead on w2, but A is served after B there
    assert fair_candidates([w1, w2], "a") == [w1]  # the flooding tenant is spread by its own count


def test_arrival_order_workers_keep_every_worker_a_candidate() -> None:
    w1, w2 = W("w1", Counter(b=3), "off"), W("w2", Counter(a=10), "off")
    assert fair_candidates([w1, w2], "b") == [w1, w2]
    mixed = [W("w1", Counter(b=3)), W("w2", Counter(a=10), "off")]
    assert fair_candidates(mixed, "b") == mixed  # one arrival-order worker: the fleet is not fair-scheduled


def test_a_tenant_alone_keeps_its_prefix_affinity() -> None:
    w1, w2 = W("w1", Counter(a=5)), W("w2")
    assert fair_candidates([w1, w2], "a") == [w1, w2]  # nobody else in flight: nothing to share
    aff = PrefixAffinity(slack=8)
    prompt = list(range(64))
    req = GenerateRequest("r", prompt, SamplingParams(max_tokens=1), tenant="a")
    first = aff.pick([w1, w2], req, 16)
    assert aff.pick(fair_candidates([w1, w2], "a"), req, 16) is first


def test_ties_among_the_fewest_all_stay_candidates() -> None:
    ws = [W("w1", Counter(a=4, b=1)), W("w2", Counter(a=1, b=1)), W("w3", Counter(a=2, b=2))]
    assert fair_candidates(ws, "b") == ws[:2]
    assert fair_candidates(ws, "c") == ws  # a new tenant has nothing anywhere


def test_the_router_counts_each_tenants_requests_per_worker() -> None:
    async def counts() -> list[tuple[int, dict[str, int]]]:
        ctx = zmq.asyncio.Context()
        w = WorkerClient("prefill", "tcp://127.0.0.1:9", ctx, check=lambda w, c: None)
        try:
            seen = []
            for tenant, n in (("a", 1), ("a", 1), ("b", 1), ("a", -1), ("b", -1)):
                w.routed(tenant, n)
                seen.append((w.inflight, dict(w.tenant_inflight)))
            return seen
        finally:
            w.sock.close(0)
            ctx.term()

    seen = asyncio.run(counts())
    assert seen[2] == (3, {"a": 2, "b": 1})
    assert seen[4] == (1, {"a": 1})  # an ended tenant leaves no entry


@dataclass
class _Kv:
    page_size: int = 16


@dataclass
class _Card:
    kv: _Kv = field(default_factory=_Kv)


@dataclass
class Served(W):
    alive: bool = True
    card: _Card = field(default_factory=_Card)


def test_the_router_picks_prefill_and_decode_workers_by_the_tenants_own_load() -> None:
    from kvseal.router.disagg import DisaggBackend

    from .conftest import FakeTokenizer

    backend = DisaggBackend(FakeTokenizer(), "m", [], [])
    busy_with_a, busy_with_b = Served("w1", Counter(a=10)), Served("w2", Counter(b=2))
    pool: list[Any] = [busy_with_b, busy_with_a]
    req_b = GenerateRequest("r", list(range(40)), SamplingParams(max_tokens=1), tenant="b")
    for role in ("prefill", "decode"):
        assert all(backend._pick(pool, role, req_b) is busy_with_a for _ in range(8)), role
    for w in pool:
        w.fairness = "off"  # arrival order: the least loaded
    assert all(backend._pick(pool, "decode", req_b) is busy_with_b for _ in range(8))

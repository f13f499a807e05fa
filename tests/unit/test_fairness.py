"""Fair shares among tenants in an engine (engine/fairness.py, engine/scheduler.py), on the tiny random model:
weights 3:1 split the tokens 3:1 while both tenants are backlogged, a tenant alone takes every slot, priority orders
requests within a tenant only, preemption hits the tenant most over its share, time away banks no credit,
kv_share caps a tenant's pages, and `off` keeps arrival order."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvseal.config import CacheConfig, EngineConfig, SchedulerConfig
from kvseal.engine.engine import Engine
from kvseal.engine.fairness import FairShare
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire.messages import GenerateRequest, SamplingParams

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def engine(ck: Checkpoint, fairness: str = "vtc", seqs: int = 4, pool_tokens: int = 2048) -> Engine:
    return Engine(EngineConfig(cache=CacheConfig(page_size=4, pool_tokens=pool_tokens),
                               scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=64,
                                                         fairness=fairness)), ck)


def req(rid: str, tenant: str, weight: float = 1.0, n: int = 12, priority: int = 0, cls: int = 0,
        kv_share: float = 1.0, params: SamplingParams = PARAMS) -> GenerateRequest:
    return GenerateRequest(rid, [2 + (len(rid) + i) % 60 for i in range(n)], params, tenant=tenant, weight=weight,
                           priority=priority, priority_class=cls, kv_share=kv_share)


def served(e: Engine) -> dict[str, int]:
    return {t: int(f["prefill_tokens"] + f["decode_tokens"]) for t, f in e.info()["tenants"].items()}  # type: ignore[union-attr]


def backlogged(e: Engine, tenants: tuple[str, ...]) -> bool:
    return all(any(s.tenant == t for s in e.scheduler.waiting) for t in tenants)


def test_weights_3_to_1_split_tokens_3_to_1_while_both_are_backlogged(tiny: Checkpoint) -> None:
    e = engine(tiny)
    for i in range(150):  # b's requests first: arrival order alone would serve b
        e.add_request(req(f"b{i}", "b", weight=1))
    for i in range(150):
        e.add_request(req(f"a{i}", "a", weight=3))
    e.step()  # from the first step on both are backlogged
    start = served(e)
    while backlogged(e, ("a", "b")):
        end = served(e)
        e.step()
    a, b = end["a"] - start.get("a", 0), end["b"] - start.get("b", 0)
    assert a + b > 1500  # a long window: the split is exact over many admissions, not over one batch's worth
    assert a / b == pytest.approx(3.0, rel=0.10)


def test_a_tenant_alone_takes_every_slot(tiny: Checkpoint) -> None:
    e = engine(tiny, seqs=4)
    for i in range(10):
        e.add_request(req(f"a{i}", "a", weight=0.1))
    e.step()
    assert len(e.scheduler.running) == 4  # work-conserving: a small weight limits nothing when no one else waits


def test_priority_orders_requests_within_a_tenant_only(tiny: Checkpoint) -> None:
    e = engine(tiny, seqs=1)
    e.add_request(req("a-late", "a", priority=5))
    e.add_request(req("a-first", "a", priority=-1))
    e.add_request(req("a-second", "a", priority=-1))
    e.add_request(req("b", "b", priority=100))
    order: list[str] = []
    while e.has_work():
        e.step()
        for s in e.scheduler.running:
            if s.request_id not in order:
                order.append(s.request_id)
    assert [r for r in order if r.startswith("a")] == ["a-first", "a-second", "a-late"]
    assert order.index("b") < order.index("a-late")  # b's poor priority does not put it behind a's other requests


def test_a_lower_class_waits_for_a_higher_one(tiny: Checkpoint) -> None:
    e = engine(tiny, seqs=1)
    e.add_request(req("batch", "batch", cls=1))
    e.add_request(req("live", "live", cls=0))
    e.step()
    assert [s.request_id for s in e.scheduler.running] == ["live"]


def test_off_keeps_arrival_order(tiny: Checkpoint) -> None:
    e = engine(tiny, fairness="off", seqs=2)
    for i in range(4):
        e.add_request(req(f"b{i}", "b"))
    e.add_request(req("a0", "a", weight=100))
    e.step()
    assert [s.request_id for s in e.scheduler.running] == ["b0", "b1"]
    assert e.info()["fairness"] == "off"


def fake(tenant: str, arrival: float, priority: int = 0, cls: int = 0, weight: float = 1.0) -> Any:
    return SimpleNamespace(tenant=tenant, arrival=arrival, priority=priority, priority_class=cls, weight=weight,
                           num_computed=0, prompt_ids=[0] * 10, pages=[])


def test_the_victim_is_from_the_tenant_most_over_its_share() -> None:
    f = FairShare("vtc")
    a1, a2, b1 = fake("a", 1.0), fake("a", 2.0, priority=3), fake("b", 3.0)
    f.charge(a1, 100)
    f.charge(b1, 10)
    assert f.victim([a1, a2, b1]) is a2  # a is most over its share; its lowest priority
    assert FairShare("off").victim([a1, a2, b1]) is b1  # off: the newest


def test_a_tenant_back_from_a_pause_banks_no_credit() -> None:
    f = FairShare("vtc")
    a, b = fake("a", 1.0), fake("b", 2.0)
    f.activate(a, set())
    f.charge(a, 1000)
    f.activate(b, {"a"})  # b was away while a was served: lifted to a's counter
    assert f.books["b"].counter == f.books["a"].counter == 1000
    f.charge(b, 300)
    c = fake("c", 3.0)
    f.activate(c, set())  # arriving at an idle engine: it owes nobody, and nobody owes it
    f.activate(a, {"c"})
    assert f.books["c"].counter == 1300 and f.books["a"].counter == 1300


def test_a_newcomer_lifted_to_the_busy_tenants_counter_goes_first_and_so_does_its_reservation() -> None:
    f = FairShare("vtc")
    a_running, a_waiting, b = fake("a", 1.0), fake("a", 2.0), fake("z", 3.0)  # "z": after "a" by name
    f.activate(a_running, set())
    f.charge(a_running, 500)
    f.activate(b, {"a"})  # lifted to a's counter: a tie
    assert f.books["z"].counter == f.books["a"].counter
    assert next(f.admission_order([a_waiting, b], [a_running])) is b  # a holds the engine: z, with nothing, first
    assert next(f.admission_order([a_waiting, b], [])) is a_waiting  # nothing held by either: the name decides
    describe = lambda q: (q.tenant, q.priority_class, q.priority, q.arrival)
    assert f.pick([a_waiting, b], describe, {"a": 3}) is b  # decode's reservation queue, the same rule
    f.charge(b, 1)
    assert next(f.admission_order([a_waiting, b], [a_running])) is a_waiting  # counters first: z got more now


def test_kv_share_caps_a_tenants_pages_but_never_stops_it(tiny: Checkpoint) -> None:
    e = engine(tiny, seqs=8, pool_tokens=400)  # 100 pages of 4 tokens; a's share 0.3: 30 pages
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(6):  # each holds 13 pages at its longest (12 prompt + 40 output tokens)
        e.add_request(req(f"a{i}", "a", n=12, kv_share=0.3, params=long))
    e.add_request(req("b0", "b", n=12, params=long))
    most, finished = 0, set()
    while e.has_work():
        for d in e.step():
            if d.final is not None:
                assert d.final == "length"
                finished.add(d.request_id)
        mine = [s for s in e.scheduler.running if s.tenant == "a"]
        assert len(mine) <= 2  # two of a's requests at their longest fit in 30 pages, three do not
        most = max(most, sum(len(s.pages) for s in mine))
    assert 13 < most <= 30 and len(finished) == 7  # every request ran to its end
    assert e.allocator.num_free == e.pool.num_pages  # seal 8: every page back
    one = engine(tiny, seqs=8, pool_tokens=400)
    one.add_request(req("big", "a", n=12, kv_share=0.05, params=long))  # 13 pages > 5: alone, it still runs
    while one.has_work():
        one.step()
    assert served(one)["a"] == 12 + 40 - 1  # every prompt token, and every output token after the first


@pytest.mark.parametrize(("weight", "kv_share"), [(0.0, 1.0), (-1.0, 1.0), (float("nan"), 1.0), (float("inf"), 1.0),
                                                  (1.0, 0.0), (1.0, 2.0), (1.0, float("nan"))])
def test_a_peers_out_of_range_weight_or_kv_share_is_refused_and_harms_nothing(tiny: Checkpoint, weight: float,
                                                                              kv_share: float) -> None:
    """Weight and kv_share reach a worker in the router's frame: the engine checks them like any field of a peer's
    message (a NaN weight would poison the tenant's counter and every later admission order)."""
    e = engine(tiny)
    free = e.allocator.num_free
    e.add_request(req("bad", "mallory", weight=weight, kv_share=kv_share))
    (final,) = [d for d in e.step() if d.request_id == "bad"] or [None]
    assert final is not None and final.error is not None and final.error.status == 400, final
    assert "out of range" in final.error.message
    assert e.allocator.num_free == free and "mallory" not in e.info()["tenants"]  # type: ignore[operator]
    e.add_request(req("good", "alice"))
    while e.has_work():
        e.step()
    assert e.allocator.num_free == free

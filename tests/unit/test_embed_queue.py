"""The embed worker's fair queue (kvseal/embed/queue.py): batches filled by virtual token counters, so one tenant's
flood delays another's request by at most the batch in progress, weights split the batches, and an aborted call's
queued inputs never run."""

from __future__ import annotations

from collections import Counter

from kvseal.embed.queue import Call, FairQueue, Piece


def call(tenant: str, n: int, tokens: int = 10, weight: float = 1.0, cid: int = 0) -> Call:
    return Call(b"router", cid, tenant, weight, [[1] * tokens for _ in range(n)])


def run(q: FairQueue, budget: int) -> list[list[Piece]]:
    batches = []
    while q.waiting:
        batches.append(q.take(budget))
    return batches


def test_one_tenants_flood_delays_another_tenants_request_by_at_most_the_batch_in_progress() -> None:
    q = FairQueue()
    for k in range(8):  # tenant a: 8 calls of 100 inputs, queued first
        q.put(call("a", 100, cid=k))
    first = q.take(budget=400)  # the batch in progress when b arrives
    assert {p.call.tenant for p in first} == {"a"}
    q.put(call("b", 3, cid=99))
    second = q.take(budget=400)
    assert [(p.call.tenant, p.stop - p.start) for p in second if p.call.tenant == "b"] == [("b", 3)]
    assert q.inputs == 800 - 40 - 37  # every input of a still waits exactly once: 40 + 37 taken


def test_weights_3_to_1_split_each_batch_3_to_1_while_both_wait() -> None:
    q = FairQueue()
    q.put(call("heavy", 300, weight=3.0, cid=1))
    q.put(call("light", 300, weight=1.0, cid=2))
    for batch in run(q, budget=400)[:5]:  # both still waiting in these
        tokens = Counter({p.call.tenant: 10 * (p.stop - p.start) for p in batch})
        assert abs(tokens["heavy"] - 3 * tokens["light"]) <= 30, tokens


def test_a_calls_inputs_are_taken_in_order_each_once_and_the_batch_respects_its_budget() -> None:
    q = FairQueue()
    q.put(call("a", 5, tokens=30, cid=1))
    q.put(call("b", 4, tokens=70, cid=2))
    seen: dict[int, list[int]] = {1: [], 2: []}
    for batch in run(q, budget=100):
        assert sum(len(p.call.ids[i]) for p in batch for i in range(p.start, p.stop)) <= 100
        for p in batch:
            seen[p.call.call_id] += list(range(p.start, p.stop))
    assert seen == {1: [0, 1, 2, 3, 4], 2: [0, 1, 2, 3]}
    big = FairQueue()
    big.put(call("a", 1, tokens=500))
    assert [(p.start, p.stop) for p in big.take(budget=100)] == [(0, 1)]  # an input over the budget still runs


def test_an_aborted_calls_queued_inputs_never_run_and_a_returning_tenant_saves_no_credit() -> None:
    q = FairQueue()
    q.put(call("a", 50, cid=1))
    q.put(call("b", 50, cid=2))
    q.take(budget=100)
    assert q.abort((b"router", 1)) is not None and q.abort((b"router", 1)) is None
    assert {p.call.tenant for batch in run(q, budget=100) for p in batch} == {"b"}
    q.put(call("b", 20, cid=3))  # b was served 500 tokens, a 50: a returning now starts level with b
    q.put(call("a", 20, cid=4))
    tokens = Counter({p.call.tenant: 10 * (p.stop - p.start) for p in q.take(budget=200)})
    assert tokens == Counter({"a": 100, "b": 100})

"""The Responses API's store (tenancy/response_store.py): an entry is its tenant's alone, each tenant keeps at most
its own entry and byte budget (its least recently used leave first), an entry past the TTL is gone, and no
tenant's writes evict or reveal another tenant's entries (seal 11)."""

from __future__ import annotations

from kvseal.config import TenantPolicy
from kvseal.tenancy.response_store import ResponseStore, StoreBudget, budget_for, entry_size

TURN = [{"role": "user", "content": "hi"}]
ONE = entry_size(TURN, {})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store(entries: int = 1024, nbytes: int = 2**20, **kw: object) -> ResponseStore:
    return ResponseStore(lambda _: StoreBudget(entries, nbytes), **kw)  # type: ignore[arg-type]


def test_an_entry_is_found_by_its_own_tenant_only() -> None:
    s = store()
    s.put("alice", "resp_1", TURN, {"id": "resp_1"})
    assert s.get("alice", "resp_1") is not None
    assert s.get("bob", "resp_1") is None and s.get("alice", "resp_2") is None
    assert not s.delete("bob", "resp_1") and s.get("alice", "resp_1") is not None
    assert s.delete("alice", "resp_1") and s.get("alice", "resp_1") is None and s.bytes_of("alice") == 0


def test_entries_past_the_ttl_are_gone() -> None:
    clock = Clock()
    s = store(ttl_s=60, clock=clock)
    s.put("alice", "old", TURN, {})
    clock.now += 30
    s.put("bob", "new", TURN, {})
    clock.now += 31
    assert s.get("alice", "old") is None and s.get("bob", "new") is not None
    clock.now += 30
    assert s.get("bob", "new") is None and len(s) == 0 and s.bytes_of("bob") == 0


def test_a_tenant_keeps_its_own_bounds_least_recently_used_first() -> None:
    s = store(entries=3)
    for i in range(3):
        s.put("alice", f"r{i}", TURN, {})
    assert s.get("alice", "r0") is not None  # r0 is now the most recently used
    s.put("alice", "r3", TURN, {})
    assert len(s) == 3 and s.get("alice", "r1") is None and s.get("alice", "r0") is not None
    small = store(nbytes=2 * ONE + ONE // 2)
    for i in range(3):
        small.put("alice", f"r{i}", TURN, {})
    assert len(small) == 2 and small.bytes_of("alice") <= 2 * ONE + ONE // 2 and small.get("alice", "r0") is None
    assert not small.put("alice", "huge", [{"role": "user", "content": "x" * 3 * ONE}], {})
    assert small.get("alice", "huge") is None and len(small) == 2


def test_one_tenant_filling_its_partition_never_evicts_another_tenants_entry() -> None:
    """The finding: 34 big writes by acme flushed globex's stored response (one LRU for everyone)."""
    s = store(entries=8, nbytes=20 * ONE)
    s.put("globex", "theirs", TURN, {"id": "theirs"})
    for i in range(200):
        s.put("acme", f"a{i}", [{"role": "user", "content": "x" * (i % 7) * 10}], {})
    assert s.get("globex", "theirs") is not None
    assert len([1 for i in range(200) if s.get("acme", f"a{i}") is not None]) <= 8


def test_another_tenants_write_does_not_reveal_its_size_through_evictions() -> None:
    """The finding: acme fills the shared store to its budget less a headroom H; whether globex's next write evicts
    acme's oldest entry told acme the size of globex's conversation. With a partition per tenant nothing of acme's
    moves, whatever globex writes and whatever H is."""
    for headroom in (1, ONE // 2, ONE, 10 * ONE):
        s = store(nbytes=50 * ONE)
        n = 0
        while s.bytes_of("acme") + ONE <= 50 * ONE - headroom:
            s.put("acme", f"a{n}", TURN, {})
            n += 1
        before = [s.get("acme", f"a{i}") is not None for i in range(n)]
        for size in (10, 1000, 40 * ONE):
            s.put("globex", f"g{size}", [{"role": "user", "content": "y" * size}], {})
        assert [s.get("acme", f"a{i}") is not None for i in range(n)] == before == [True] * n


def test_the_budget_comes_from_the_tenants_store_mb() -> None:
    assert budget_for(TenantPolicy(store_mb=2)).bytes == 2 * 2**20
    assert budget_for(TenantPolicy()).bytes == 64 * 2**20

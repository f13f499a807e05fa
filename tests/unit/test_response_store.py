"""The Responses API's store (router/response_store.py): an entry is its tenant's alone, the store keeps at most
its entry and byte bounds (least recently used leave first), and an entry past the TTL is gone."""

from __future__ import annotations

from kvseal.router.response_store import ResponseStore

TURN = [{"role": "user", "content": "hi"}]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_entry_is_found_by_its_own_tenant_only() -> None:
    store = ResponseStore()
    store.put("alice", "resp_1", TURN, {"id": "resp_1"})
    assert store.get("alice", "resp_1") is not None
    assert store.get("bob", "resp_1") is None and store.get("alice", "resp_2") is None
    assert not store.delete("bob", "resp_1") and store.get("alice", "resp_1") is not None
    assert store.delete("alice", "resp_1") and store.get("alice", "resp_1") is None and store.bytes == 0


def test_entries_past_the_ttl_are_gone() -> None:
    clock = Clock()
    store = ResponseStore(ttl_s=60, clock=clock)
    store.put("alice", "old", TURN, {})
    clock.now += 30
    store.put("alice", "new", TURN, {})
    clock.now += 31
    assert store.get("alice", "old") is None and store.get("alice", "new") is not None
    clock.now += 30
    assert store.get("alice", "new") is None and len(store) == 0 and store.bytes == 0


def test_the_store_keeps_its_bounds_least_recently_used_first() -> None:
    store = ResponseStore(max_entries=3)
    for i in range(3):
        store.put("alice", f"r{i}", TURN, {})
    assert store.get("alice", "r0") is not None  # r0 is now the most recently used
    store.put("bob", "r3", TURN, {})
    assert len(store) == 3 and store.get("alice", "r1") is None and store.get("alice", "r0") is not None
    one = store.bytes // 3
    small = ResponseStore(max_bytes=2 * one + one // 2)
    for i in range(3):
        small.put("alice", f"r{i}", TURN, {})
    assert len(small) == 2 and small.bytes <= small.max_bytes and small.get("alice", "r0") is None
    small.put("alice", "huge", [{"role": "user", "content": "x" * small.max_bytes}], {})
    assert small.get("alice", "huge") is None and len(small) == 2

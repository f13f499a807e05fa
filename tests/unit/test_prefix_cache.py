"""The prefix cache beside the allocator: keys, sharing, refcounts, eviction with scrub, and seal 5/9 checks.

The stateful test drives allocator + cache the way the engine does (admit with a cache lookup, compute into
owned pages, insert full pages, share, release, preempt, allocate under pressure) and checks after every
step that the books balance, no referenced page was evicted or changed, and every free page is zero.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvseal.kv.allocator import IntegrityError, NotOwner, OutOfPages, Owner, PageAllocator, pages_for
from kvseal.kv.prefix_cache import PrefixCache, namespace_id, namespace_root, page_keys

PS = 4


def test_keys_are_a_chain_split_by_tenant_and_salt() -> None:
    a = namespace_root("alice", None)
    ids = list(range(10, 22))  # three full pages
    ka = page_keys(a, ids, PS)
    assert len(ka) == 3 and len(set(ka)) == 3
    assert page_keys(a, ids + [1, 2], PS) == ka  # a trailing partial page has no key
    diverged = page_keys(a, ids[:4] + [99] + ids[5:], PS)
    assert diverged[0] == ka[0] and diverged[1] != ka[1] and diverged[2] != ka[2]  # chained: one change, all after
    assert page_keys(a, ids[4:], PS, parent=ka[0]) == ka[1:]
    for other in (namespace_root("bob", None), namespace_root("alice", "s"), namespace_root("alice", "")):
        assert other != a and not set(page_keys(other, ids, PS)) & set(ka)
    assert namespace_root("ab", "c") != namespace_root("a", "bc")


def _setup(n: int = 8) -> tuple[PageAllocator, PrefixCache, np.ndarray]:
    data = np.zeros(n)

    def scrub(pages: list[int]) -> None:
        data[list(pages)] = 0

    alloc = PageAllocator(n, scrubber=scrub)
    return alloc, PrefixCache(alloc), data


def test_insert_share_release_evict() -> None:
    alloc, cache, data = _setup()
    root = namespace_root("t", None)
    ns, keys = namespace_id(root), page_keys(root, list(range(12)), PS)
    first = alloc.new_owner()
    pages = alloc.allocate(first, 3)
    data[pages] = 7
    assert cache.insert(first, ns, keys, pages) == 3
    assert alloc.num_cached == 3 and cache.num_referenced == 3 and alloc.num_free == 5
    second = alloc.new_owner()
    assert cache.acquire(second, ns, keys[:2]) == pages[:2]  # shared, not copied
    assert alloc.may_read(second, ns, pages[:2]) and not alloc.may_read(second, ns, pages)
    cache.release(first.key)
    assert cache.num_evictable == 1 and alloc.num_free == 6  # pages[2] is unreferenced now
    alloc.check_integrity()
    held = alloc.allocate(alloc.new_owner(), 6)  # short by one: the unreferenced page is evicted, scrubbed
    assert pages[2] in held and data[pages[2]] == 0 and data[pages[:2]].tolist() == [7, 7]
    with pytest.raises(OutOfPages):
        alloc.allocate(alloc.new_owner(), 1)  # the shared pages are referenced: never evicted
    cache.release(second.key)
    assert cache.clear() == 2 and data.sum() == 0 and alloc.num_cached == 0
    alloc.check_integrity()


def test_insert_refuses_pages_the_holder_does_not_own() -> None:
    alloc, cache, _ = _setup()
    root = namespace_root("t", None)
    a, b = alloc.new_owner(), alloc.new_owner()
    pa, pb = alloc.allocate(a, 1), alloc.allocate(b, 1)
    with pytest.raises(NotOwner):
        cache.insert(a, namespace_id(root), page_keys(root, list(range(8)), PS), pa + pb)
    assert alloc.num_cached == 0 and alloc.owns(a, pa) and alloc.owns(b, pb)  # nothing changed
    alloc.check_integrity()


def test_other_tenants_and_stale_holders_are_refused() -> None:
    alloc, cache, _ = _setup()
    ra, rb = namespace_root("alice", None), namespace_root("bob", None)
    ids = list(range(8))
    alice, bob = alloc.new_owner(), alloc.new_owner()
    pages = alloc.allocate(alice, 2)
    cache.insert(alice, namespace_id(ra), page_keys(ra, ids, PS), pages)
    assert cache.acquire(bob, namespace_id(rb), page_keys(rb, ids, PS)) == []  # same tokens, other tenant
    # a table naming alice's cached pages, under either namespace, does not pass for bob (seal 5)
    assert not alloc.may_read(bob, namespace_id(rb), pages) and not alloc.may_read(bob, namespace_id(ra), pages)
    assert alloc.may_read(alice, namespace_id(ra), pages) and not alloc.may_read(alice, namespace_id(rb), pages)
    assert not alloc.may_read(alloc.next_epoch(alice), namespace_id(ra), pages)  # preempted: held nothing since
    with pytest.raises(NotOwner):
        cache.acquire(alloc.next_epoch(alice), namespace_id(ra), page_keys(ra, ids, PS))


def test_check_integrity_sees_a_refcount_bug() -> None:
    alloc, cache, _ = _setup()
    root = namespace_root("t", None)
    o = alloc.new_owner()
    cache.insert(o, namespace_id(root), page_keys(root, list(range(4)), PS), alloc.allocate(o, 1))
    cache._refs[cache._page_of[page_keys(root, list(range(4)), PS)[0]]] += 1  # a leaked reference
    with pytest.raises(IntegrityError):
        alloc.check_integrity()


# -- the stateful test --------------------------------------------------------------------------------------
PROMPTS = [list(range(2, 2 + 14)), list(range(2, 2 + 9)) + [40, 41, 42, 43, 44], [50, 51, 52, 53] * 3, [9] * 6]
NUM_PAGES = 16


def _value(key: bytes) -> float:
    return float(int.from_bytes(key[:4], "little") | 1)  # what "computing" the page under this key writes


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.data = np.zeros(NUM_PAGES)
        self.alloc = PageAllocator(NUM_PAGES, scrubber=self._scrub)
        self.cache = PrefixCache(self.alloc)
        self.live: dict[int, tuple[Owner, int, list[bytes], list[int]]] = {}  # key -> (owner, ns, keys, pages)
        self.written: dict[int, float] = {}  # page -> what was written into it (live pages only)

    def _scrub(self, pages: list[int]) -> None:
        self.data[list(pages)] = 0

    @rule(prompt=st.sampled_from(range(len(PROMPTS))), tenant=st.sampled_from(["a", "b"]),
          salt=st.sampled_from([None, "s"]))
    def admit(self, prompt: int, tenant: str, salt: str | None) -> None:
        ids = PROMPTS[prompt]
        root = namespace_root(tenant, salt)
        ns, keys = namespace_id(root), page_keys(root, ids, PS)
        owner = self.alloc.new_owner()
        self._start(owner, ns, keys, len(ids))

    def _start(self, owner: Owner, ns: int, keys: list[bytes], num_tokens: int) -> None:
        hit = self.cache.acquire(owner, ns, keys[: (num_tokens - 1) // PS])
        for p, k in zip(hit, keys):
            assert self.data[p] == _value(k), "a shared page does not hold its key's KV"
        try:
            own = self.alloc.allocate(owner, pages_for(num_tokens, PS) - len(hit))
        except OutOfPages:
            self.cache.release(owner.key)
            return
        for i, p in enumerate(own, start=len(hit)):
            assert self.data[p] == 0, "allocate() handed out a page that was not scrubbed"
            self.data[p] = _value(keys[i]) if i < len(keys) else 1.0  # the partial page: any KV
        self.live[owner.key] = (owner, ns, keys, hit + own)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        owner, ns, keys, pages = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        self.cache.insert(owner, ns, keys, pages[: len(keys)])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.live)))
        self.cache.release(key)
        self.alloc.free_all(key)
        del self.live[key]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.live)))
        owner, ns, keys, pages = self.live.pop(key)
        self.cache.release(key)
        self.alloc.free_all(key)
        self._start(self.alloc.next_epoch(owner), ns, keys, len(pages) * PS)

    @rule(n=st.integers(1, NUM_PAGES))
    def pressure(self, n: int) -> None:
        """Someone else needs n pages now: unreferenced cached pages are evicted for it, then it is done."""
        o = self.alloc.new_owner()
        try:
            self.alloc.allocate(o, n)
        except OutOfPages:
            assert n > self.alloc.num_free
        self.alloc.free_all(o.key)

    @invariant()
    def books_balance(self) -> None:
        self.alloc.check_integrity()
        held = sum(len(v[3]) for v in self.live.values())
        assert self.alloc.num_free + self.cache.num_referenced + self.alloc.num_owned == NUM_PAGES
        assert self.alloc.num_owned + self.cache.num_referenced <= held

    @invariant()
    def live_pages_are_intact(self) -> None:
        for owner, ns, keys, pages in self.live.values():
            assert self.alloc.may_read(owner, ns, pages)  # nothing it holds was evicted or taken
            for i, p in enumerate(pages[: len(keys)]):
                assert self.data[p] == _value(keys[i])

    @invariant()
    def free_pages_are_zero(self) -> None:
        free = list(self.alloc._free)
        assert not self.data[free].any()


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCacheMachine = CacheMachine.TestCase

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvseal.kv.allocator import IntegrityError, NotOwner, OutOfPages, PageAllocator


def test_allocate_free_roundtrip_and_integrity() -> None:
    a = PageAllocator(8)
    o1, o2 = a.new_owner(), a.new_owner()
    p1, p2 = a.allocate(o1, 3), a.allocate(o2, 5)
    assert set(p1).isdisjoint(p2) and a.num_free == 0
    a.check_integrity()
    with pytest.raises(OutOfPages):
        a.allocate(o1, 1)
    a.free(o1, p1)
    assert a.num_free == 3
    a.check_integrity()


def test_free_refuses_pages_the_caller_does_not_own() -> None:
    a = PageAllocator(8)
    o1, o2 = a.new_owner(), a.new_owner()
    p1, p2 = a.allocate(o1, 2), a.allocate(o2, 2)
    with pytest.raises(NotOwner):
        a.free(o1, [p1[0], p2[0]])
    # nothing changed: o2 still owns its page, o1 still owns both of its own
    assert a.owns(o2, p2) and a.owns(o1, p1) and a.num_free == 4
    with pytest.raises(NotOwner):
        a.free(o1, [p1[0], p1[0]])


def test_stale_epoch_does_not_own() -> None:
    a = PageAllocator(4)
    o = a.new_owner()
    pages = a.allocate(o, 2)
    newer = a.next_epoch(o)
    assert a.owns(o, pages) and not a.owns(newer, pages)
    with pytest.raises(NotOwner):
        a.free(newer, pages)


def test_scrubber_runs_before_pages_return() -> None:
    data = np.ones(6)
    seen_free: list[int] = []

    def scrub(pages: list[int]) -> None:
        seen_free.append(a.num_free)
        data[list(pages)] = 0

    a = PageAllocator(6, scrubber=scrub)
    o = a.new_owner()
    pages = a.allocate(o, 4)
    a.free(o, pages)
    assert seen_free == [2]  # scrubbed while the pages were still off the free list
    assert data[pages].sum() == 0


def test_check_integrity_detects_corruption() -> None:
    a = PageAllocator(4)
    o = a.new_owner()
    a.allocate(o, 2)
    a._free.append(a._free[0])  # a bug that double-lists a page
    with pytest.raises(IntegrityError):
        a.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5), st.booleans()), max_size=40))
def test_random_operations_keep_the_books(ops: list[tuple[int, int, bool]]) -> None:
    a = PageAllocator(16)
    owners = [a.new_owner() for _ in range(5)]
    held: dict[int, list[int]] = {i: [] for i in range(5)}
    for who, n, do_free in ops:
        if do_free:
            a.free(owners[who], held[who])
            held[who] = []
        else:
            try:
                held[who] += a.allocate(owners[who], n)
            except OutOfPages:
                assert n > a.num_free
        a.check_integrity()
        assert a.num_free == 16 - sum(len(v) for v in held.values())


def test_free_all_returns_every_epoch_of_an_owner() -> None:
    a = PageAllocator(8)
    o, other = a.new_owner(), a.new_owner()
    a.allocate(o, 2)
    a.allocate(a.next_epoch(o), 3)
    keep = a.allocate(other, 1)
    assert a.free_all(o.key) == 5
    assert a.num_free == 7 and a.owns(other, keep)
    a.check_integrity()

"""The page allocator: a free list and an owner per page. It knows nothing of torch.

Invariants (check_integrity):
  - every page is exactly one of: free (owner == FREE), owned by one Owner, or cached (owner == CACHED: held
    by the prefix cache, read-only, see prefix_cache.py);
  - len(free list) + owned pages + cached pages == num_pages, and the free list holds no duplicates;
  - a page returns to the free list only after the scrubber has zeroed it (when scrubbing is on), so a
    page handed out by allocate() never holds an earlier request's KV (seal 6). A cached page is scrubbed
    when the cache evicts it, never before: while cached it is never written.
  - with a cache attached, check_integrity also checks the cache's books (refcounts, LRU, index).
An owner is (key, epoch): key names the request, epoch changes each time the request is (re)allocated
after a preemption, so a stale page table from an earlier incarnation does not pass check_owned (seal 5).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np

FREE = -1
CACHED = -2  # the page belongs to the prefix cache (shared read-only by the requests that hold it)


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold num_tokens tokens: ceil(num_tokens / page_size)."""
    return -(-num_tokens // page_size)


class Owner(NamedTuple):
    key: int  # a request's numeric key, unique per allocator lifetime
    epoch: int


class OutOfPages(Exception):
    """Not enough free pages right now; the caller may wait, preempt, or refuse."""


class IntegrityError(AssertionError):
    """The allocator's books do not balance: a bug, never a user error."""


class NotOwner(Exception):
    """A caller tried to free or use pages it does not own. Nothing was changed."""


class PageCache(Protocol):
    """What the allocator needs from a prefix cache attached to it (kvseal.kv.prefix_cache.PrefixCache)."""

    @property
    def num_evictable(self) -> int: ...

    def evict(self, n: int) -> int: ...

    def holds(self, owner: Owner, namespace: int, pages: Sequence[int]) -> bool: ...

    def check_integrity(self) -> None: ...


class PageAllocator:
    def __init__(self, num_pages: int, scrubber: Callable[[Sequence[int]], None] | None = None) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._scrubber = scrubber
        self._free: deque[int] = deque(range(num_pages))
        self._owner_key = np.full(num_pages, FREE, dtype=np.int64)
        self._owner_epoch = np.full(num_pages, FREE, dtype=np.int64)
        self._next_key = 0
        self._cache: PageCache | None = None

    def attach(self, cache: PageCache) -> None:
        """Let `cache` hold pages (CACHED), evict unreferenced ones when allocate() runs short, and vouch
        for the cached pages in a request's table (seal 5)."""
        if self._cache is not None:
            raise ValueError("a prefix cache is already attached to this allocator")
        self._cache = cache

    # -- owners -------------------------------------------------------------------------------------
    def new_owner(self) -> Owner:
        self._next_key += 1
        return Owner(self._next_key, 0)

    @staticmethod
    def next_epoch(owner: Owner) -> Owner:
        return Owner(owner.key, owner.epoch + 1)

    # -- allocation ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages allocate() can hand out now: the free list plus cached pages no request holds (evicted,
        scrubbed, on demand). With nothing running this equals num_pages (seal 8: the pool's baseline)."""
        return len(self._free) + (self._cache.num_evictable if self._cache is not None else 0)

    @property
    def num_cached(self) -> int:
        return int(np.count_nonzero(self._owner_key == CACHED))

    @property
    def num_owned(self) -> int:
        return int(np.count_nonzero(self._owner_key >= 0))

    def allocate(self, owner: Owner, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free) and self._cache is not None and n <= self.num_free:
            self._cache.evict(n - len(self._free))  # least recently used unreferenced pages, scrubbed
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {self.num_free} free of {self.num_pages}")
        pages = [self._free.popleft() for _ in range(n)]
        idx = np.asarray(pages, dtype=np.int64)
        self._owner_key[idx] = owner.key
        self._owner_epoch[idx] = owner.epoch
        return pages

    def free(self, owner: Owner, pages: Sequence[int]) -> None:
        """Scrub and return `pages`. Refuses (NotOwner, nothing changed) unless `owner` owns every one."""
        if not pages:
            return
        if len(set(pages)) != len(pages):
            raise NotOwner(f"duplicate pages in free(): {sorted(pages)}")
        if not self.owns(owner, pages):
            raise NotOwner(f"{owner} does not own all of pages {list(pages)[:8]}...")
        if self._scrubber is not None:
            self._scrubber(pages)
        idx = np.asarray(pages, dtype=np.int64)
        self._owner_key[idx] = FREE
        self._owner_epoch[idx] = FREE
        self._free.extend(pages)

    def free_all(self, key: int) -> int:
        """Scrub and return every page whose owner key is `key`, at any epoch; returns how many.

        Used when a request ends or is preempted: the owner array, not the request's own page table
        (which may be the thing that is wrong), decides what it holds.
        """
        pages = np.flatnonzero(self._owner_key == key).tolist()
        if pages:
            if self._scrubber is not None:
                self._scrubber(pages)
            self._owner_key[pages] = FREE
            self._owner_epoch[pages] = FREE
            self._free.extend(pages)
        return len(pages)

    # -- the prefix cache's side (called by PrefixCache only) ---------------------------------------------
    def to_cache(self, owner: Owner, pages: Sequence[int]) -> None:
        """Hand `owner`'s pages to the cache (owner -> CACHED). Refuses (NotOwner, nothing changed) otherwise."""
        if len(set(pages)) != len(pages) or not self.owns(owner, pages):
            raise NotOwner(f"{owner} does not own all of pages {list(pages)[:8]} it would cache")
        idx = np.asarray(pages, dtype=np.int64)
        self._owner_key[idx] = CACHED
        self._owner_epoch[idx] = CACHED

    def from_cache(self, pages: Sequence[int]) -> None:
        """Scrub cached pages and return them to the free list (the cache evicted them)."""
        if not pages:
            return
        idx = np.asarray(pages, dtype=np.int64)
        if len(set(pages)) != len(pages) or not bool(np.all(self._owner_key[idx] == CACHED)):
            raise NotOwner(f"pages {list(pages)[:8]} are not all cached")
        if self._scrubber is not None:
            self._scrubber(pages)
        self._owner_key[idx] = FREE
        self._owner_epoch[idx] = FREE
        self._free.extend(pages)

    def cached_pages(self) -> list[int]:
        return np.flatnonzero(self._owner_key == CACHED).tolist()

    def cached(self, pages: Sequence[int]) -> bool:
        idx = np.asarray(pages, dtype=np.int64)
        return bool(idx.size == 0 or (idx.min() >= 0 and idx.max() < self.num_pages
                                      and np.all(self._owner_key[idx] == CACHED)))

    # -- ownership ----------------------------------------------------------------------------------
    def may_read(self, owner: Owner, namespace: int, pages: Sequence[int]) -> bool:
        """Seal 5: every page in `pages` is owned by `owner`, or is a cached page that `owner` holds under
        its own cache namespace (tenant and cache_salt). Anything else: False."""
        if not pages:
            return True
        idx = np.asarray(pages, dtype=np.int64)
        if idx.min() < 0 or idx.max() >= self.num_pages:
            return False
        owned = (self._owner_key[idx] == owner.key) & (self._owner_epoch[idx] == owner.epoch)
        if bool(np.all(owned)):
            return True
        rest = idx[~owned]
        return (self._cache is not None and bool(np.all(self._owner_key[rest] == CACHED))
                and self._cache.holds(owner, namespace, rest.tolist()))

    def owns(self, owner: Owner, pages: Sequence[int]) -> bool:
        if not pages:
            return True
        idx = np.asarray(pages, dtype=np.int64)
        if idx.min() < 0 or idx.max() >= self.num_pages:
            return False
        return bool(np.all(self._owner_key[idx] == owner.key) and np.all(self._owner_epoch[idx] == owner.epoch))

    def owner_of(self, page: int) -> tuple[int, int]:
        """(owner key, epoch) of one page: FREE or CACHED in both for a free or cached page."""
        return int(self._owner_key[page]), int(self._owner_epoch[page])

    def owned_by(self, owner: Owner) -> list[int]:
        mask = (self._owner_key == owner.key) & (self._owner_epoch == owner.epoch)
        return np.flatnonzero(mask).tolist()

    def check_integrity(self) -> None:
        """Raise IntegrityError if the free list, the owner array and the attached cache disagree."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise IntegrityError("duplicate page in the free list")
        owned, cached = self.num_owned, self.num_cached
        if len(free) + owned + cached != self.num_pages:
            raise IntegrityError(f"free {len(free)} + owned {owned} + cached {cached} != total {self.num_pages}")
        if free and not bool(np.all(self._owner_key[np.asarray(free)] == FREE)):
            raise IntegrityError("a page on the free list has an owner")
        if not bool(np.all((self._owner_key >= 0) == (self._owner_epoch >= 0))):
            raise IntegrityError("a page's owner key and epoch disagree on whether it is owned")
        if cached and self._cache is None:
            raise IntegrityError(f"{cached} pages are marked cached but no cache is attached")
        if self._cache is not None:
            self._cache.check_integrity()

"""The page allocator: a free list and an owner per page. It knows nothing of torch.

Invariants (check_integrity):
  - every page is either free (owner == FREE) or owned by exactly one Owner, never both;
  - len(free list) + owned pages == num_pages, and the free list holds no duplicates;
  - a page returns to the free list only after the scrubber has zeroed it (when scrubbing is on), so a
    page handed out by allocate() never holds an earlier request's KV (seal 6).
An owner is (key, epoch): key names the request, epoch changes each time the request is (re)allocated
after a preemption, so a stale page table from an earlier incarnation does not pass check_owned (seal 5).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

FREE = -1


class Owner(NamedTuple):
    key: int  # a request's numeric key, unique per allocator lifetime
    epoch: int


class OutOfPages(Exception):
    """Not enough free pages right now; the caller may wait, preempt, or refuse."""


class IntegrityError(AssertionError):
    """The allocator's books do not balance: a bug, never a user error."""


class NotOwner(Exception):
    """A caller tried to free or use pages it does not own. Nothing was changed."""


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
        return len(self._free)

    def allocate(self, owner: Owner, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free of {self.num_pages}")
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

    def owns(self, owner: Owner, pages: Sequence[int]) -> bool:
        if not pages:
            return True
        idx = np.asarray(pages, dtype=np.int64)
        if idx.min() < 0 or idx.max() >= self.num_pages:
            return False
        return bool(np.all(self._owner_key[idx] == owner.key) and np.all(self._owner_epoch[idx] == owner.epoch))

    def owned_by(self, owner: Owner) -> list[int]:
        mask = (self._owner_key == owner.key) & (self._owner_epoch == owner.epoch)
        return np.flatnonzero(mask).tolist()

    def check_integrity(self) -> None:
        """Raise IntegrityError if the free list and the owner array disagree."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise IntegrityError("duplicate page in the free list")
        owned = int(np.count_nonzero(self._owner_key != FREE))
        if len(free) + owned != self.num_pages:
            raise IntegrityError(f"free {len(free)} + owned {owned} != total {self.num_pages}")
        if free and not bool(np.all(self._owner_key[np.asarray(free)] == FREE)):
            raise IntegrityError("a page on the free list has an owner")

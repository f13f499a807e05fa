"""The prefix cache: full KV pages kept after the request that computed them, shared read-only, never across
tenants (seal 9). Plain Python and numpy, no torch; the pages stay in the allocator, marked CACHED.

Keys: a hash chain. A namespace root is hash(tenant, cache_salt); page i of a prompt is keyed by
hash(root, key of page i-1, the page's token ids). Equal keys mean the same tokens at the same positions
after the same prefix in the same namespace, so a page found under a key holds exactly the KV a request in
that namespace would compute there. Only full pages are cached.

A cached page's life:  OWNED by the request that computed it --insert--> CACHED, referenced (refs >= 1)
  --release by every holder--> CACHED, unreferenced (on the LRU) --acquire--> referenced again
  --evict (only when unreferenced)--> scrubbed --> FREE.

Invariants (check_integrity, also run by the allocator's):
  - the index (key <-> page) is a bijection over exactly the pages the allocator marks CACHED;
  - refs[p] == the number of holders holding p; pages not cached have refs 0 and no holder;
  - the LRU holds exactly the cached pages with refs == 0: a referenced page is never evicted;
  - each cached page records its namespace; holds() (seal 5) accepts a page only for a holder that holds it
    and asks under that same namespace, so one tenant's table can never name another tenant's page.
A holder is an Owner (request key, epoch): a preempted request releases everything it held and its next
epoch starts with nothing.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvseal.kv.allocator import IntegrityError, NotOwner, Owner, PageAllocator

_DIGEST = 16  # bytes of blake2b: keys are compared, never trusted alone (namespace is checked per page too)


def namespace_root(tenant: str, cache_salt: str | None) -> bytes:
    """The root of a namespace's hash chain. Length-prefixed fields: ("ab", "c") and ("a", "bc") differ, and
    so do no salt and an empty one."""
    t = tenant.encode("utf-8", "surrogatepass")
    parts = [b"kvseal-prefix-v1", len(t).to_bytes(4, "little"), t]
    if cache_salt is not None:
        s = cache_salt.encode("utf-8", "surrogatepass")
        parts += [b"\x01", len(s).to_bytes(4, "little"), s]
    else:
        parts.append(b"\x00")
    return hashlib.blake2b(b"".join(parts), digest_size=_DIGEST).digest()


def namespace_id(root: bytes) -> int:
    """A namespace as one int64, stored per cached page for the seal-5 check."""
    return int.from_bytes(root[:8], "little", signed=True)


def page_keys(root: bytes, token_ids: Sequence[int], page_size: int, parent: bytes | None = None) -> list[bytes]:
    """Keys of the full pages of `token_ids` (a trailing partial page has none), chained from `parent` (the
    key of the page before token_ids[0], or the root when it starts at position 0)."""
    n = len(token_ids) // page_size
    if n == 0:
        return []
    data = np.asarray(token_ids[: n * page_size], dtype="<i8").tobytes()
    step = page_size * 8
    keys, prev = [], parent if parent is not None else root
    for i in range(n):
        prev = hashlib.blake2b(root + prev + data[i * step : (i + 1) * step], digest_size=_DIGEST).digest()
        keys.append(prev)
    return keys


class PrefixCache:
    def __init__(self, allocator: PageAllocator, enabled: bool = True) -> None:
        self.allocator, self.enabled = allocator, enabled
        n = allocator.num_pages
        self._page_of: dict[bytes, int] = {}  # key -> cached page
        self._key_of: dict[int, bytes] = {}  # cached page -> key
        self._ns = np.zeros(n, dtype=np.int64)  # namespace of each cached page
        self._refs = np.zeros(n, dtype=np.int64)
        self._held: dict[int, tuple[Owner, set[int]]] = {}  # holder's request key -> (holder, pages held)
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, least recent first
        self.hit_tokens = 0  # counters for /info: tokens served from the cache ...
        self.evicted_pages = 0  # ... and pages evicted (scrubbed) to make room
        allocator.attach(self)

    # -- counts -------------------------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    @property
    def num_referenced(self) -> int:
        return len(self._key_of) - len(self._lru)

    # -- requests -------------------------------------------------------------------------------------
    def acquire(self, holder: Owner, namespace: int, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest cached prefix of `keys` in `namespace`, each now referenced by `holder`
        (read-only: the holder must never write them)."""
        if not self.enabled:
            return []
        pages: list[int] = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None or self._ns[page] != namespace:
                break
            pages.append(page)
        if pages:
            self._hold(holder, pages)
        return pages

    def insert(self, holder: Owner, namespace: int, keys: Sequence[bytes], pages: Sequence[int]) -> int:
        """Hand `holder`'s full pages (page i holds the KV under keys[i]) to the cache; `holder` keeps a
        reference to each. Pages it already holds from the cache are skipped, and so is a page whose key is
        already cached under another page (that one stays the holder's own). Returns how many were added."""
        if not self.enabled:
            return 0
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        new = [(k, p) for k, p in zip(keys, pages) if k not in self._page_of and p not in self._key_of]
        if not new:
            return 0
        self.allocator.to_cache(holder, [p for _, p in new])  # NotOwner (nothing changed) unless all its own
        for k, p in new:
            self._page_of[k], self._key_of[p] = p, k
            self._ns[p] = namespace
        self._hold(holder, [p for _, p in new])
        return len(new)

    def release(self, key: int) -> int:
        """Drop every reference held by the request with this key (any epoch); returns how many."""
        entry = self._held.pop(key, None)
        if entry is None:
            return 0
        for p in sorted(entry[1]):
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._lru[p] = None  # most recently used end
        return len(entry[1])

    def holds(self, owner: Owner, namespace: int, pages: Sequence[int]) -> bool:
        """Seal 5 for cached pages: `owner` (this exact epoch) holds every page, each cached in `namespace`."""
        entry = self._held.get(owner.key)
        if entry is None or entry[0] != owner:
            return False
        held = entry[1]
        return all(p in held and p in self._key_of and self._ns[p] == namespace for p in pages)

    def _hold(self, holder: Owner, pages: Sequence[int]) -> None:
        entry = self._held.get(holder.key)
        if entry is None:
            entry = self._held[holder.key] = (holder, set())
        elif entry[0] != holder:
            raise NotOwner(f"{holder} still holds cached pages as {entry[0]}: release them first")
        for p in pages:
            if p in entry[1]:
                continue
            entry[1].add(p)
            self._refs[p] += 1
            self._lru.pop(p, None)

    # -- eviction -------------------------------------------------------------------------------------
    def evict(self, n: int) -> int:
        """Scrub and free up to n unreferenced pages, least recently used first; returns how many."""
        victims: list[int] = []
        while self._lru and len(victims) < n:
            p, _ = self._lru.popitem(last=False)
            del self._page_of[self._key_of.pop(p)]
            self._ns[p] = 0
            victims.append(p)
        self.allocator.from_cache(victims)
        self.evicted_pages += len(victims)
        return len(victims)

    def clear(self) -> int:
        """Evict every unreferenced page (referenced ones stay until their holders release them)."""
        return self.evict(len(self._lru))

    # -- books ----------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        marked = set(self.allocator.cached_pages())
        if set(self._key_of) != marked:
            raise IntegrityError(f"cache index holds {len(self._key_of)} pages, the allocator marks {len(marked)}")
        if len(self._page_of) != len(self._key_of) or any(self._key_of[p] != k for k, p in self._page_of.items()):
            raise IntegrityError("the cache's key -> page and page -> key maps disagree")
        counts = np.zeros_like(self._refs)
        for key, (holder, pages) in self._held.items():
            if holder.key != key:
                raise IntegrityError(f"holder {holder} filed under key {key}")
            for p in pages:
                if p not in self._key_of:
                    raise IntegrityError(f"{holder} holds page {p}, which is not cached")
                counts[p] += 1
        if not np.array_equal(counts, self._refs):
            bad = np.flatnonzero(counts != self._refs)[:8].tolist()
            raise IntegrityError(f"refcounts disagree with the holders on pages {bad}")
        unreferenced = {p for p in self._key_of if self._refs[p] == 0}
        if set(self._lru) != unreferenced or len(self._lru) != len(unreferenced):
            raise IntegrityError("the LRU is not exactly the unreferenced cached pages")

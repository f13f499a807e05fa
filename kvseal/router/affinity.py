"""Cache-aware choice of a prefill worker: send a prompt where its prefix most likely sits in the prefix cache.

The router remembers where it sent the first pages of recent prompts, keyed by the same hash chain the
workers' caches use (kvseal.kv.prefix_cache: per tenant and cache_salt, so one tenant's traffic never steers by
another's). Like SGLang's cache-aware router, in page-hash form:
  1. the deepest of a prompt's first-page keys that was last sent to a live worker names a candidate;
  2. the candidate gets the request unless it carries more than `slack` requests above the least loaded worker
     (a hot prefix must not pile everything on one worker);
  3. otherwise, and when nothing matches, the least loaded worker, ties broken at random;
  4. every key of the request then points at the chosen worker (bounded LRU: old prefixes are forgotten).
A wrong guess costs a recompute, never correctness: each worker checks its own cache per tenant.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, TypeVar

from kvseal.kv.prefix_cache import namespace_root, page_keys
from kvseal.wire.messages import GenerateRequest


class _Worker(Protocol):
    endpoint: str

    @property
    def inflight(self) -> int: ...


W = TypeVar("W", bound=_Worker)


class PrefixAffinity:
    def __init__(self, max_entries: int = 65536, max_pages: int = 32, slack: int = 4) -> None:
        self.max_entries, self.max_pages, self.slack = max_entries, max_pages, slack
        self._where: OrderedDict[bytes, str] = OrderedDict()  # page key -> endpoint it was last sent to
        self.routed_by_prefix = 0  # requests that followed a remembered prefix (for /info)

    def pick(self, live: Sequence[W], req: GenerateRequest, page_size: int) -> W:
        """One of `live` (non-empty) for `req`."""
        least = min(w.inflight for w in live)
        keys = page_keys(namespace_root(req.tenant, req.cache_salt),
                         req.prompt_ids[: self.max_pages * page_size], page_size)
        by_endpoint = {w.endpoint: w for w in live}
        chosen = None
        for key in reversed(keys):
            w = by_endpoint.get(self._where.get(key, ""))
            if w is not None:
                if w.inflight <= least + self.slack:
                    chosen = w
                    self.routed_by_prefix += 1
                break
        if chosen is None:
            chosen = random.choice([w for w in live if w.inflight == least])
        for key in keys:
            self._where[key] = chosen.endpoint
            self._where.move_to_end(key)
        while len(self._where) > self.max_entries:
            self._where.popitem(last=False)
        return chosen

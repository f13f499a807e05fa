"""Stored responses of the Responses API, for previous_response_id and GET /v1/responses/{id}: a partition per tenant.

Each entry belongs to the tenant that created it: a lookup is by (tenant, id), so another tenant's id is exactly
as absent as one that never existed (404 either way; nothing tells them apart).

Each tenant has its own budget (`budget_of(tenant)`: at most `entries` entries and `bytes` of their conversations
and bodies; the tenants file's `store_mb=` sets the bytes) and its own least-recently-used order. A tenant's write
only ever evicts that tenant's own entries (seal 11): another tenant can neither flush them nor, by filling its own
partition, learn how large they are. An entry older than `ttl_s` is gone, whoever it belongs to.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvseal.config import TenantPolicy

ENTRIES = 1024  # per tenant
TTL_S = 3600.0


@dataclass(frozen=True)
class StoreBudget:
    entries: int
    bytes: int


@dataclass(frozen=True)
class Stored:
    conversation: list[dict[str, Any]]  # chat-template messages: its input (and what it continued) and its output
    body: dict[str, Any]  # the Response object as it was answered
    created: float
    size: int


Key = tuple[str, str]  # (tenant, response id)


@dataclass
class _Partition:
    entries: OrderedDict[Key, Stored] = field(default_factory=OrderedDict)  # least recently used first
    bytes: int = 0

    def drop(self, key: Key) -> bool:
        gone = self.entries.pop(key, None)
        if gone is not None:
            self.bytes -= gone.size
        return gone is not None


def budget_for(policy: TenantPolicy) -> StoreBudget:
    return StoreBudget(ENTRIES, int(policy.store_mb * 2**20))


def entry_size(conversation: list[dict[str, Any]], body: dict[str, Any]) -> int:
    """What an entry counts against its tenant's bytes."""
    return len(json.dumps([conversation, body], ensure_ascii=False).encode())


class ResponseStore:
    def __init__(self, budget_of: Callable[[str], StoreBudget], ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.budget_of, self.ttl_s, self.clock = budget_of, ttl_s, clock
        self._parts: dict[str, _Partition] = {}  # partition_of(tenant) -> its entries

    def __len__(self) -> int:
        return sum(len(p.entries) for p in self._parts.values())

    def bytes_of(self, tenant: str) -> int:
        part = self._parts.get(partition_of(tenant))
        return 0 if part is None else part.bytes

    def put(self, tenant: str, rid: str, conversation: list[dict[str, Any]], body: dict[str, Any]) -> bool:
        """Keep an entry, evicting the tenant's own least recently used ones to fit; False when it is larger than
        the tenant's whole budget (never kept: a later lookup is a 404)."""
        size, budget = entry_size(conversation, body), self.budget_of(tenant)
        if size > budget.bytes:
            return False
        self._expire()
        part = self._parts.setdefault(partition_of(tenant), _Partition())
        part.drop((tenant, rid))
        part.entries[(tenant, rid)] = Stored(conversation, body, self.clock(), size)
        part.bytes += size
        while len(part.entries) > budget.entries or part.bytes > budget.bytes:
            part.drop(next(iter(part.entries)))
        return True

    def get(self, tenant: str, rid: str) -> Stored | None:
        self._expire()
        part = self._parts.get(partition_of(tenant))
        found = None if part is None else part.entries.get((tenant, rid))
        if found is not None and part is not None:
            part.entries.move_to_end((tenant, rid))
        return found

    def delete(self, tenant: str, rid: str) -> bool:
        self._expire()
        part = self._parts.get(partition_of(tenant))
        return part is not None and part.drop((tenant, rid))

    def _expire(self) -> None:
        cutoff = self.clock() - self.ttl_s
        for name, part in list(self._parts.items()):
            for key in [k for k, v in part.entries.items() if v.created <= cutoff]:
                part.drop(key)
            if not part.entries:
                del self._parts[name]


def partition_of(tenant: str) -> str:
    """Whose budget and LRU order an entry counts in: its own tenant's, never a pool shared with others."""
    return tenant

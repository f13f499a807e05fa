"""Stored responses of the Responses API, for previous_response_id and GET /v1/responses/{id}.

Each entry belongs to the tenant that created it: a lookup is by (tenant, id), so another tenant's id is exactly
as absent as one that never existed (404 either way; nothing tells them apart). The store is bounded: at most
`max_entries` entries and `max_bytes` of their conversations and bodies (least recently used leave first), and
an entry older than `ttl_s` is gone.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_ENTRIES = 4096
MAX_BYTES = 256 * 1024 * 1024
TTL_S = 3600.0


@dataclass(frozen=True)
class Stored:
    conversation: list[dict[str, Any]]  # chat-template messages: its input (and what it continued) and its output
    body: dict[str, Any]  # the Response object as it was answered
    created: float
    size: int


class ResponseStore:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.max_bytes, self.ttl_s, self.clock = max_entries, max_bytes, ttl_s, clock
        self._entries: OrderedDict[tuple[str, str], Stored] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tenant: str, rid: str, conversation: list[dict[str, Any]], body: dict[str, Any]) -> None:
        size = len(json.dumps([conversation, body], ensure_ascii=False).encode())
        if size > self.max_bytes:
            return  # larger than the whole store: never kept (a later lookup is a 404)
        self._drop((tenant, rid))
        self._entries[(tenant, rid)] = Stored(conversation, body, self.clock(), size)
        self.bytes += size
        self._expire()
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def get(self, tenant: str, rid: str) -> Stored | None:
        self._expire()
        found = self._entries.get((tenant, rid))
        if found is not None:
            self._entries.move_to_end((tenant, rid))
        return found

    def delete(self, tenant: str, rid: str) -> bool:
        self._expire()
        return self._drop((tenant, rid))

    def _drop(self, key: tuple[str, str]) -> bool:
        gone = self._entries.pop(key, None)
        if gone is not None:
            self.bytes -= gone.size
        return gone is not None

    def _expire(self) -> None:
        cutoff = self.clock() - self.ttl_s
        for key in [k for k, v in self._entries.items() if v.created <= cutoff]:
            self._drop(key)

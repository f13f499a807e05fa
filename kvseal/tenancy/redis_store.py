"""Stored responses in Redis: every router reads what any router stored, each tenant in its own partition, sealed.

The same rules as tenancy/response_store.py, kept in Redis:
- an entry `kvseal:resp:<entry_of(tenant, id)>` holds the entry sealed with the tenant's key (sealer.Sealer)
  and expires after the TTL;
- per tenant (`name_of(tenant)`): a sorted set of its entries by last use and a hash of their sizes; a put evicts
  the tenant's own least recently used entries until its entries and bytes fit its budget, in one Lua script.
A lookup by another tenant computes another key, and an entry that does not open under the caller's key (moved,
changed) is as absent as one that never existed. Redis unreachable: StateUnavailable (503), never a guess.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from cryptography.exceptions import InvalidTag
from redis.exceptions import RedisError

from kvseal.errors import StateUnavailable
from kvseal.tenancy.response_store import TTL_S, StoreBudget, Stored, entry_size
from kvseal.tenancy.sealer import PREFIX, Sealer

SEQ = f"{PREFIX}uses"
# KEYS: entry, the tenant's LRU set (scored by a counter of uses: the order of uses, even within a millisecond), its
# sizes. ARGV: member, sealed value, size, ttl ms, max entries, max bytes, the entries' key prefix, the counter.
# -> the members evicted
PUT = """
local member, size = ARGV[1], tonumber(ARGV[3])
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[4])
redis.call('ZADD', KEYS[2], redis.call('INCR', ARGV[8]), member)
redis.call('HSET', KEYS[3], member, size)
redis.call('PEXPIRE', KEYS[2], ARGV[4]) redis.call('PEXPIRE', KEYS[3], ARGV[4])
local total = 0
for _, v in ipairs(redis.call('HVALS', KEYS[3])) do total = total + tonumber(v) end
local gone = {}
while redis.call('ZCARD', KEYS[2]) > tonumber(ARGV[5]) or total > tonumber(ARGV[6]) do
  local oldest = redis.call('ZPOPMIN', KEYS[2])[1]
  total = total - (tonumber(redis.call('HGET', KEYS[3], oldest)) or 0)
  redis.call('HDEL', KEYS[3], oldest)
  redis.call('DEL', ARGV[7] .. oldest)
  gone[#gone + 1] = oldest
end
return gone
"""
# KEYS: entry, LRU set, sizes. ARGV: member, the counter. -> the sealed value, or false (its index entry gone with it)
GET = """
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('ZREM', KEYS[2], ARGV[1]) redis.call('HDEL', KEYS[3], ARGV[1])
  return false
end
redis.call('ZADD', KEYS[2], 'XX', redis.call('INCR', ARGV[2]), ARGV[1])
return v
"""
DELETE = """
redis.call('ZREM', KEYS[2], ARGV[1]) redis.call('HDEL', KEYS[3], ARGV[1])
return redis.call('DEL', KEYS[1])
"""


class RedisResponses:
    def __init__(self, client: Any, sealer: Sealer, budget_of: Callable[[str], StoreBudget],
                 ttl_s: float = TTL_S) -> None:
        self.client, self.sealer, self.budget_of, self.ttl_ms = client, sealer, budget_of, int(ttl_s * 1000)
        self._put, self._get, self._del = (client.register_script(s) for s in (PUT, GET, DELETE))

    def _keys(self, tenant: str, rid: str) -> tuple[list[str], str]:
        member, name = self.sealer.entry_of(tenant, rid), self.sealer.name_of(tenant)
        return [f"{PREFIX}resp:{member}", f"{PREFIX}lru:{name}", f"{PREFIX}size:{name}"], member

    async def put(self, tenant: str, rid: str, conversation: list[dict[str, Any]], body: dict[str, Any]) -> bool:
        size, budget = entry_size(conversation, body), self.budget_of(tenant)
        if size > budget.bytes:
            return False
        keys, member = self._keys(tenant, rid)
        plain = json.dumps({"conversation": conversation, "body": body, "created": time.time()},
                           ensure_ascii=False).encode()
        await self._call(self._put, keys, [member, self.sealer.seal(tenant, keys[0], plain), size, self.ttl_ms,
                                           budget.entries, budget.bytes, f"{PREFIX}resp:", SEQ])
        return True

    async def get(self, tenant: str, rid: str) -> Stored | None:
        keys, member = self._keys(tenant, rid)
        sealed = await self._call(self._get, keys, [member, SEQ])
        if not sealed:
            return None
        try:
            entry = json.loads(self.sealer.open(tenant, keys[0], sealed))
        except (InvalidTag, ValueError):
            return None  # not this tenant's, or changed at rest: as absent as a made-up id
        return Stored(entry["conversation"], entry["body"], entry["created"], 0)

    async def delete(self, tenant: str, rid: str) -> bool:
        keys, member = self._keys(tenant, rid)
        return bool(await self._call(self._del, keys, [member]))

    async def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            return await script(keys=keys, args=args)
        except (RedisError, OSError) as exc:
            raise StateUnavailable(f"stored responses cannot be reached ({type(exc).__name__}); please try again "
                                   f"shortly") from None

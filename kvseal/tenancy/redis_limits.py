"""Each tenant's max_concurrent, rpm and tpm held in Redis, atomically across every router (issue 34).

The same rules as tenancy/limits.py, each decision one Lua script run inside Redis on Redis's own clock, so no two
routers can both take the last request of a minute or the last place in flight:
- rpm and tpm: token buckets (level, at) that hold a minute's worth and refill at limit/60 a second;
- max_concurrent: a sorted set of the tenant's places in flight, each a lease that expires unless its router renews
  it (every lease_s / 3). A router that dies (kill -9, a lost node) leaves its places behind for at most lease_s.
Redis unreachable: admit and charge raise StateUnavailable (503, fail closed); a release that cannot reach it is
dropped, and its lease expires by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections import Counter
from typing import Any

from redis.exceptions import RedisError

from kvseal.config import TenantPolicy
from kvseal.errors import RateLimited, StateUnavailable
from kvseal.tenancy.limits import Lease, duration
from kvseal.tenancy.sealer import PREFIX, Sealer

log = logging.getLogger("kvseal.state")

_NOW = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"
_LEVEL = """
local function level(key, cap, now)
  local b = redis.call('HMGET', key, 'level', 'at')
  local lv, at = tonumber(b[1]), tonumber(b[2])
  if lv == nil then return cap end
  return math.min(cap, lv + (now - at) * cap / 60000.0)
end
"""
# KEYS: in-flight set, requests bucket, tokens bucket. ARGV: max_concurrent (-1: none), rpm (-1), lease id, lease ms,
# tpm (-1). -> {0, requests level, tokens level} admitted | {1, in flight} over max_concurrent | {2, ms} over rpm
ADMIT = _NOW + _LEVEL + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local maxc, rpm = tonumber(ARGV[1]), tonumber(ARGV[2])
if maxc >= 0 then
  local n = redis.call('ZCARD', KEYS[1])
  if n >= maxc then return {1, n} end
end
if rpm >= 0 then
  local lv = level(KEYS[2], rpm, now)
  if lv < 1 then return {2, tostring(math.ceil((1 - lv) * 60000.0 / rpm))} end
  redis.call('HSET', KEYS[2], 'level', tostring(lv - 1), 'at', tostring(now))
  redis.call('PEXPIRE', KEYS[2], 120000)
end
if maxc >= 0 then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[4]), ARGV[3])
  redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[4]))
end
local tpm = tonumber(ARGV[5])
local req_left = rpm >= 0 and tostring(level(KEYS[2], rpm, now)) or '-1'
return {0, req_left, tpm >= 0 and tostring(level(KEYS[3], tpm, now)) or '-1'}
"""
# KEYS: tokens bucket. ARGV: tpm, tokens wanted. -> {0, level after} taken | {1, ms to wait, used}
CHARGE = _NOW + _LEVEL + """
local tpm, want = tonumber(ARGV[1]), tonumber(ARGV[2])
local lv = level(KEYS[1], tpm, now)
if lv < want then return {1, tostring(math.ceil((want - lv) * 60000.0 / tpm)), tostring(tpm - math.floor(lv))} end
redis.call('HSET', KEYS[1], 'level', tostring(lv - want), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], 120000)
return {0, tostring(lv - want)}
"""
# KEYS: in-flight set, tokens bucket. ARGV: lease id, tpm (-1: none), tokens given back.
RELEASE = _NOW + _LEVEL + """
redis.call('ZREM', KEYS[1], ARGV[1])
local tpm, back = tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm >= 0 and back > 0 then
  local lv = level(KEYS[2], tpm, now)
  redis.call('HSET', KEYS[2], 'level', tostring(math.min(tpm, lv + back)), 'at', tostring(now))
  redis.call('PEXPIRE', KEYS[2], 120000)
end
return {0}
"""
# KEYS: requests bucket, tokens bucket. ARGV: rpm, tpm (-1: none). -> the two levels now
LEVELS = _NOW + _LEVEL + """
local out = {}
for i = 1, 2 do
  local cap = tonumber(ARGV[i])
  out[i] = cap >= 0 and tostring(level(KEYS[i], cap, now)) or '-1'
end
return out
"""
# KEYS: in-flight sets. ARGV: lease ms, then per key one lease id (the leases of this router, key by key)
RENEW = _NOW + """
for i = 1, #KEYS do
  redis.call('ZADD', KEYS[i], now + tonumber(ARGV[1]), ARGV[i + 1])
  redis.call('PEXPIRE', KEYS[i], 2 * tonumber(ARGV[1]))
end
return #KEYS
"""


class RedisLimits:
    def __init__(self, client: Any, sealer: Sealer, policies: dict[str, TenantPolicy], lease_s: float) -> None:
        self.client, self.sealer, self.policies, self.lease_ms = client, sealer, policies, int(lease_s * 1000)
        self._scripts = {name: client.register_script(src) for name, src in
                         (("admit", ADMIT), ("charge", CHARGE), ("release", RELEASE), ("levels", LEVELS),
                          ("renew", RENEW))}
        self.router = secrets.token_hex(6)  # this router's leases are named after it
        self._live: dict[str, str] = {}  # lease id -> its tenant's in-flight set: renewed until released
        self._renewing: asyncio.Task[None] | None = None
        self._in_flight: Counter[str] = Counter()  # this router's own, for /metrics
        self._refused: dict[str, Counter[str]] = {}

    def _keys(self, tenant: str) -> tuple[str, str, str]:
        n = self.sealer.name_of(tenant)
        return f"{PREFIX}fly:{n}", f"{PREFIX}rpm:{n}", f"{PREFIX}tpm:{n}"

    async def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self._scripts[name](keys=keys, args=args)
        except (RedisError, OSError) as exc:
            raise StateUnavailable(f"the tenants' shared state cannot be reached ({type(exc).__name__}); this "
                                   f"request was not admitted. Please try again shortly.") from None

    async def admit(self, tenant: str) -> Lease:
        p = self.policies.get(tenant)
        lease = Lease(tenant)
        if p is not None and (p.max_concurrent is not None or p.rpm is not None or p.tpm is not None):
            fly, rpm_key, tpm_key = self._keys(tenant)
            lease.token = f"{self.router}:{secrets.token_hex(8)}"
            out = await self._run("admit", [fly, rpm_key, tpm_key], [
                -1 if p.max_concurrent is None else p.max_concurrent, -1 if p.rpm is None else p.rpm, lease.token,
                self.lease_ms, -1 if p.tpm is None else p.tpm])
            if int(out[0]) == 1:
                self._refuse(tenant, "requests")
                raise RateLimited(f"Rate limit reached for tenant {tenant} on concurrent requests: Limit "
                                  f"{p.max_concurrent}, In flight {int(out[1])}. Please try again when one of "
                                  f"them has finished.", kind="requests", retry_after_s=1.0)
            if int(out[0]) == 2:
                wait = float(out[1]) / 1000
                self._refuse(tenant, "requests")
                raise RateLimited(f"Rate limit reached for tenant {tenant} on requests per min (RPM): Limit "
                                  f"{p.rpm}, Used {p.rpm}, Requested 1. Please try again in {duration(wait)}.",
                                  kind="requests", retry_after_s=wait)
            now = time.monotonic()
            lease.levels = {kind: (float(v), now) for kind, v in (("requests", out[1]), ("tokens", out[2]))
                            if float(v) >= 0}
            if p.max_concurrent is not None:
                self._live[lease.token] = fly
                self._start_renewing()
        self._in_flight[tenant] += 1
        return lease

    async def charge(self, lease: Lease, prompt_tokens: int, max_output: int) -> None:
        p = self.policies.get(lease.tenant)
        lease.used = prompt_tokens
        if p is None or p.tpm is None:
            return
        want = prompt_tokens + max_output
        if want > p.tpm:
            self._refuse(lease.tenant, "tokens")
            raise RateLimited(f"Request too large for tenant {lease.tenant} on tokens per min (TPM): Limit {p.tpm}, "
                              f"Requested {want} ({prompt_tokens} in the prompt, {max_output} for the completion). "
                              f"Lower max_tokens or the prompt.", kind="tokens", retry_after_s=None)
        out = await self._run("charge", [self._keys(lease.tenant)[2]], [p.tpm, want])
        if int(out[0]) == 1:
            wait = float(out[1]) / 1000
            self._refuse(lease.tenant, "tokens")
            raise RateLimited(f"Rate limit reached for tenant {lease.tenant} on tokens per min (TPM): Limit {p.tpm}, "
                              f"Used {int(out[2])}, Requested {want}. Please try again in {duration(wait)}.",
                              kind="tokens", retry_after_s=wait)
        lease.charged = want
        lease.levels["tokens"] = (float(out[1]), time.monotonic())

    async def release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        self._in_flight[lease.tenant] -= 1
        p = self.policies.get(lease.tenant)
        if p is None or (lease.token == "" and lease.charged <= lease.used):
            return
        self._live.pop(lease.token, None)
        fly, _, tpm_key = self._keys(lease.tenant)
        try:
            await self._run("release", [fly, tpm_key], [lease.token, -1 if p.tpm is None else p.tpm,
                                                         max(0, lease.charged - lease.used)])
        except StateUnavailable:  # its place expires by itself within the lease; the refund is lost
            log.warning("could not release a request of tenant %s in the shared state; its place expires within "
                        "%g s", lease.tenant, self.lease_ms / 1000)

    async def headers(self, tenant: str, lease: Lease | None) -> list[tuple[str, str]]:
        """From the levels the request's own admission and charge returned (refilled since, locally), else one
        round trip (a refused request's)."""
        p = self.policies.get(tenant)
        if p is None or (p.rpm is None and p.tpm is None):
            return []
        now = time.monotonic()
        if lease is not None and lease.levels:
            levels = {k: min(cap, lv + (now - at) * cap / 60) for k, (lv, at), cap in
                      ((k, lease.levels[k], p.rpm if k == "requests" else p.tpm) for k in lease.levels)
                      if cap is not None}
        else:
            _, rpm_key, tpm_key = self._keys(tenant)
            try:
                got = await self._run("levels", [rpm_key, tpm_key], [-1 if p.rpm is None else p.rpm,
                                                                    -1 if p.tpm is None else p.tpm])
            except StateUnavailable:
                return []
            levels = {"requests": float(got[0]), "tokens": float(got[1])}
        out: list[tuple[str, str]] = []
        for kind, cap in (("requests", p.rpm), ("tokens", p.tpm)):
            if cap is None or kind not in levels:
                continue
            level = levels[kind]
            out += [(f"x-ratelimit-limit-{kind}", str(cap)), (f"x-ratelimit-remaining-{kind}", str(math.floor(level))),
                    (f"x-ratelimit-reset-{kind}", duration((cap - level) * 60 / cap))]
        return out

    def figures(self) -> dict[str, dict[str, int]]:
        """tenant -> this router's requests in flight and its 429s by type (the fleet's: the sum over routers)."""
        out = {}
        for t in self.policies:
            refused = self._refused.get(t, Counter())
            out[t] = {"in_flight": self._in_flight[t], "rate_limited_requests": refused["requests"],
                      "rate_limited_tokens": refused["tokens"]}
        return out

    async def close(self) -> None:
        if self._renewing is not None:
            self._renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewing

    def _refuse(self, tenant: str, kind: str) -> None:
        self._refused.setdefault(tenant, Counter())[kind] += 1

    def _start_renewing(self) -> None:
        if self._renewing is None or self._renewing.done():
            self._renewing = asyncio.ensure_future(self._renew_forever())

    async def _renew_forever(self) -> None:
        """This router's places in flight, renewed every lease_s / 3 (and put back after a Redis restart)."""
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            live = list(self._live.items())
            if not live:
                continue
            try:
                await self._run("renew", [fly for _, fly in live], [self.lease_ms, *[t for t, _ in live]])
            except StateUnavailable:
                log.warning("could not renew %d request(s) in flight in the shared state", len(live))

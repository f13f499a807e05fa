"""Per-tenant quotas and rate limits, kept by the router (they hold whatever happens to the workers).

Each tenant with a limit in the tenants file (config.TenantPolicy) has:
- a requests bucket (rpm) and a tokens bucket (tpm): token buckets that hold at most a minute's worth and refill
  continuously at limit/60 per second, so a burst may use the whole minute and then one request (or token) comes
  back every 60/limit seconds;
- a count of its requests in flight (max_concurrent): every endpoint that does work (tenancy/ratelimit.py).
A request takes one from the requests bucket and a place in flight when it arrives (before its body is read),
and prompt + n * max_tokens from the tokens bucket once its prompt is tokenized, before any worker sees it; when
it ends, the output it did not produce goes back to the tokens bucket. Invariant: a bucket's level stays in
[0, capacity] and in_flight >= 0; every `admit` is matched by exactly one `release`.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvseal.config import TenantPolicy
from kvseal.errors import RateLimited


class Bucket:
    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # per second
        self.level, self.at = self.capacity, now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_for(self, n: float) -> float:
        """Seconds until n is in the bucket (after refill); 0 when it is now."""
        return max(0.0, (n - self.level) / self.rate)

    def reset_s(self) -> float:
        """Seconds until the bucket is full again (OpenAI's x-ratelimit-reset-*)."""
        return (self.capacity - self.level) / self.rate


@dataclass
class Lease:
    """One admitted request's hold on its tenant's limits, released once when the response is over."""

    tenant: str
    charged: int = 0  # tokens taken from the tokens bucket
    used: int = 0  # prompt + output tokens the request actually produced so far
    released: bool = False
    token: str = ""  # its place in flight in the shared state (tenancy/redis_limits.py); "" when it holds none
    # the shared state's bucket levels as its last answer gave them ("requests"/"tokens" -> (level, monotonic
    # time)): its x-ratelimit-* headers without another round trip
    levels: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass
class _Tenant:
    policy: TenantPolicy
    requests: Bucket | None
    tokens: Bucket | None
    in_flight: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # 429s by type: "requests" | "tokens"


class RateLimiter:
    def __init__(self, policies: dict[str, TenantPolicy], clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        now = clock()
        self.tenants = {t: _Tenant(p, Bucket(p.rpm, now) if p.rpm else None, Bucket(p.tpm, now) if p.tpm else None)
                        for t, p in policies.items()}

    def admit(self, tenant: str) -> Lease:
        """A request arrives: its place in flight and one request from the bucket, or RateLimited."""
        t = self.tenants.get(tenant)
        lease = Lease(tenant)
        if t is None:
            return lease
        now = self.clock()
        p = t.policy
        if p.max_concurrent is not None and t.in_flight >= p.max_concurrent:
            t.refused["requests"] += 1
            raise RateLimited(f"Rate limit reached for tenant {tenant} on concurrent requests: Limit "
                              f"{p.max_concurrent}, In flight {t.in_flight}. Please try again when one of them "
                              f"has finished.", kind="requests", retry_after_s=1.0)
        if t.requests is not None:
            t.requests.refill(now)
            if t.requests.level < 1:
                wait = t.requests.wait_for(1)
                t.refused["requests"] += 1
                raise RateLimited(f"Rate limit reached for tenant {tenant} on requests per min (RPM): Limit "
                                  f"{p.rpm}, Used {p.rpm}, Requested 1. Please try again in {duration(wait)}.",
                                  kind="requests", retry_after_s=wait)
            t.requests.level -= 1
        t.in_flight += 1
        return lease

    def charge(self, lease: Lease, prompt_tokens: int, max_output: int) -> None:
        """Take prompt + max_output tokens for this request, or RateLimited (its place in flight stays until
        release)."""
        t = self.tenants.get(lease.tenant)
        lease.used = prompt_tokens
        if t is None or t.tokens is None:
            return
        want = prompt_tokens + max_output
        b = t.tokens
        b.refill(self.clock())
        if want > b.capacity:
            t.refused["tokens"] += 1
            raise RateLimited(f"Request too large for tenant {lease.tenant} on tokens per min (TPM): Limit "
                              f"{t.policy.tpm}, Requested {want} ({prompt_tokens} in the prompt, {max_output} for "
                              f"the completion). Lower max_tokens or the prompt.", kind="tokens", retry_after_s=None)
        if b.level < want:
            wait = b.wait_for(want)
            t.refused["tokens"] += 1
            raise RateLimited(f"Rate limit reached for tenant {lease.tenant} on tokens per min (TPM): Limit "
                              f"{t.policy.tpm}, Used {int(b.capacity) - math.floor(b.level)}, Requested {want}. Please "
                              f"try again in {duration(wait)}.", kind="tokens", retry_after_s=wait)
        b.level -= want
        lease.charged = want

    def release(self, lease: Lease) -> None:
        """The request is over (any outcome): its place in flight back, and the tokens it did not use."""
        if lease.released:
            return
        lease.released = True
        t = self.tenants.get(lease.tenant)
        if t is None:
            return
        t.in_flight -= 1
        if t.tokens is not None and lease.charged > lease.used:
            t.tokens.refill(self.clock())
            t.tokens.level = min(t.tokens.capacity, t.tokens.level + lease.charged - lease.used)

    def headers(self, tenant: str) -> list[tuple[str, str]]:
        """OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens} for the limits this tenant has."""
        t = self.tenants.get(tenant)
        out: list[tuple[str, str]] = []
        if t is None:
            return out
        now = self.clock()
        for kind, b in (("requests", t.requests), ("tokens", t.tokens)):
            if b is None:
                continue
            b.refill(now)
            out += [(f"x-ratelimit-limit-{kind}", str(int(b.capacity))),
                    (f"x-ratelimit-remaining-{kind}", str(math.floor(b.level))),
                    (f"x-ratelimit-reset-{kind}", duration(b.reset_s()))]
        return out

    def figures(self) -> dict[str, dict[str, int]]:
        """tenant -> in flight and 429s by type, for /metrics."""
        return {name: {"in_flight": t.in_flight, "rate_limited_requests": t.refused["requests"],
                       "rate_limited_tokens": t.refused["tokens"]} for name, t in self.tenants.items()}


def duration(seconds: float) -> str:
    """OpenAI's reset format: "20ms", "1.5s", "6m0s"."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    m, s = divmod(math.ceil(seconds), 60)
    return f"{m}m{s}s"

"""Where a tenant's limits and stored responses live: this router's memory (the default), or Redis, shared by every
router of a fleet (`--state redis://HOST:PORT/DB`, tenancy/redis_limits.py and tenancy/redis_store.py).

Both sides speak the same two async interfaces, so the routes and the middleware never know which one runs:
- Limits: admit a request (max_concurrent, rpm), charge its tokens (tpm), release it, and the tenant's
  x-ratelimit-* headers;
- Responses: put, get and delete a stored response under (tenant, id), each tenant in its own partition.
With Redis, what cannot be decided because Redis is unreachable fails closed: StateUnavailable (503 with
Retry-After), never a request admitted without its limits and never a stored response of someone else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvseal.config import ServerConfig, TenantPolicy
from kvseal.tenancy.limits import Lease, RateLimiter
from kvseal.tenancy.response_store import ResponseStore, StoreBudget, Stored, budget_for


class Limits(Protocol):
    async def admit(self, tenant: str) -> Lease: ...

    async def charge(self, lease: Lease, prompt_tokens: int, max_output: int) -> None: ...

    async def release(self, lease: Lease) -> None: ...

    async def headers(self, tenant: str, lease: Lease | None) -> list[tuple[str, str]]:
        """The tenant's x-ratelimit-* headers; `lease`: the request's own, when it was admitted."""
        ...

    def figures(self) -> dict[str, dict[str, int]]: ...


class Responses(Protocol):
    def budget_of(self, tenant: str) -> StoreBudget: ...

    async def put(self, tenant: str, rid: str, conversation: list[dict[str, Any]], body: dict[str, Any]) -> bool: ...

    async def get(self, tenant: str, rid: str) -> Stored | None: ...

    async def delete(self, tenant: str, rid: str) -> bool: ...


class LocalLimits:
    """This router's own buckets (tenancy/limits.py), behind the async interface."""

    def __init__(self, limiter: RateLimiter) -> None:
        self.limiter = limiter

    async def admit(self, tenant: str) -> Lease:
        return self.limiter.admit(tenant)

    async def charge(self, lease: Lease, prompt_tokens: int, max_output: int) -> None:
        self.limiter.charge(lease, prompt_tokens, max_output)

    async def release(self, lease: Lease) -> None:
        self.limiter.release(lease)

    async def headers(self, tenant: str, lease: Lease | None) -> list[tuple[str, str]]:
        return self.limiter.headers(tenant)

    def figures(self) -> dict[str, dict[str, int]]:
        return self.limiter.figures()


class LocalResponses:
    """This router's own store (tenancy/response_store.py), behind the async interface."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self.budget_of = store.budget_of

    async def put(self, tenant: str, rid: str, conversation: list[dict[str, Any]], body: dict[str, Any]) -> bool:
        return self.store.put(tenant, rid, conversation, body)

    async def get(self, tenant: str, rid: str) -> Stored | None:
        return self.store.get(tenant, rid)

    async def delete(self, tenant: str, rid: str) -> bool:
        return self.store.delete(tenant, rid)


@dataclass
class TenantState:
    limits: Limits
    responses: Responses
    close: Callable[[], Any]  # awaitable or None: what ends it (Redis: its renewals and connections)
    where: str  # for the start-up log: "memory" or the Redis address without its password


def build_state(cfg: ServerConfig, policies: dict[str, TenantPolicy]) -> TenantState:
    def budget(tenant: str) -> StoreBudget:
        return budget_for(policies.get(tenant, TenantPolicy()))

    if cfg.state is None:
        return TenantState(LocalLimits(RateLimiter(policies)), LocalResponses(ResponseStore(budget)),
                           lambda: None, "memory")
    from kvseal.tenancy.redis_state import connect_state, redacted

    limits, responses, close = connect_state(cfg, policies, budget)
    return TenantState(limits, responses, close, redacted(cfg.state))

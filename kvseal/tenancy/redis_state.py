"""Tenant state in Redis, shared by every router: the connection, the limits and the stored responses on it, each
tenant named and sealed there by the server secret (tenancy/sealer.py). tenancy/state.py chooses it for
`--state redis://...`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from kvseal.config import ServerConfig, TenantPolicy
from kvseal.tenancy.redis_limits import RedisLimits
from kvseal.tenancy.redis_store import RedisResponses
from kvseal.tenancy.response_store import StoreBudget
from kvseal.tenancy.sealer import Sealer, read_secret


def redacted(url: str) -> str:
    """The address without a password, for logs."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path or '/0'}"


def connect_state(cfg: ServerConfig, policies: dict[str, TenantPolicy], budget: Callable[[str], StoreBudget]
                  ) -> tuple[RedisLimits, RedisResponses, Callable[[], Awaitable[None]]]:
    """The limits and the stored responses in the Redis of `cfg.state`, and what closes them."""
    import redis.asyncio as aioredis

    assert cfg.state is not None and cfg.state_secret_file is not None  # ServerConfig checks both
    secret = read_secret(cfg.state_secret_file, "--state-secret-file", 32)
    password = (read_secret(cfg.state_password_file, "--state-password-file", 1).decode()
                if cfg.state_password_file else None)
    client = aioredis.from_url(cfg.state, password=password, socket_timeout=2.0, socket_connect_timeout=2.0,
                               health_check_interval=10)
    sealer = Sealer(secret)
    limits = RedisLimits(client, sealer, policies, cfg.state_lease_s)
    responses = RedisResponses(client, sealer, budget)

    async def close() -> None:
        await limits.close()
        await client.aclose()

    return limits, responses, close

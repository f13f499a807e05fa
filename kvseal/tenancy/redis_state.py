"""Tenant state in Redis, shared by every router: the connection, and how a tenant is named and sealed there.

Nothing in Redis names a tenant in clear: a tenant's keys carry `name_of(tenant)`, a keyed hash (HMAC-SHA256 under
the server secret), and a stored response's key hashes the tenant and the response id together. A stored response
is encrypted with AES-256-GCM under the tenant's own key, derived by HKDF-SHA256 from the server secret and the
tenant's name, its Redis key bound in as associated data (an entry moved to another key does not open). Whoever
holds Redis's data but not the secret reads no conversation and cannot tell which tenant wrote what.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from urllib.parse import urlsplit

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvseal.config import ServerConfig, TenantPolicy
from kvseal.tenancy.response_store import StoreBudget
from kvseal.tenancy.state import TenantState, read_secret

PREFIX = "kvseal:"
NONCE = 12


class Sealer:
    """Names and keys from the server secret: keyed hashes for Redis keys, a key per tenant for its entries."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._keys: dict[str, AESGCM] = {}

    def name_of(self, tenant: str) -> str:
        return self._mac(b"tenant\0" + tenant.encode())

    def entry_of(self, tenant: str, rid: str) -> str:
        return self._mac(b"entry\0" + tenant.encode() + b"\0" + rid.encode())

    def seal(self, tenant: str, key: str, plain: bytes) -> bytes:
        nonce = os.urandom(NONCE)
        return nonce + self._aead(tenant).encrypt(nonce, plain, key.encode())

    def open(self, tenant: str, key: str, sealed: bytes) -> bytes:
        """The plaintext; raises cryptography's InvalidTag when the entry is not this tenant's or was changed."""
        return self._aead(tenant).decrypt(sealed[:NONCE], sealed[NONCE:], key.encode())

    def _mac(self, data: bytes) -> str:
        return hmac.new(self._secret, data, hashlib.sha256).hexdigest()[:32]

    def _aead(self, tenant: str) -> AESGCM:
        found = self._keys.get(tenant)
        if found is None:
            key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                       info=b"kvseal stored responses v1\0" + tenant.encode()).derive(self._secret)
            found = self._keys[tenant] = AESGCM(key)
        return found


def redacted(url: str) -> str:
    """The address without a password, for logs."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path or '/0'}"


def connect_state(cfg: ServerConfig, policies: dict[str, TenantPolicy],
                  budget: Callable[[str], StoreBudget]) -> TenantState:
    import redis.asyncio as aioredis

    from kvseal.tenancy.redis_limits import RedisLimits
    from kvseal.tenancy.redis_store import RedisResponses

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

    return TenantState(limits, responses, close, redacted(cfg.state))

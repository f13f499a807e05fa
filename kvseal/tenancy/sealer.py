"""How a tenant is named and sealed in the Redis that every router shares (tenancy/redis_state.py), by the server
secret.

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
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

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


def read_secret(path: str, what: str, least: int) -> bytes:
    """A secret's bytes from its file (surrounding whitespace dropped); errors name the flag, never the content."""
    try:
        data = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"invalid {what}={path!r}: cannot read it ({type(exc).__name__})") from None
    if len(data) < least:
        raise ValueError(f"invalid {what}={path!r}: it holds {len(data)} bytes; give at least {least} random "
                         f"bytes (e.g. `head -c 32 /dev/urandom | base64 > FILE`)")
    return data

"""Authenticated-only framing of the ZeroMQ KV channel, the default with fleet keys: KV bytes cross in clear,
every message both ways carries a MAC, and only a holder of the session's token completes the connection.

Why not CURVE here: CURVE encrypts every byte in libzmq's one I/O thread per connection (XSalsa20-Poly1305 with
copies), which cut the ZeroMQ KV transfer to a third to a half of its speed (docs/benchmarks.md). A MAC is one
keyed-hash pass per side (0.50-0.68x there: cheaper, not free); the hash is keyed BLAKE3 (a PRF, SIMD in one
pass: about 4x HMAC-SHA256 on the same loaded core), because the rest of this path runs at memory speed. The
control channels and NIXL's offers stay CURVE (small messages, encrypted); `--kv-channel curve` keeps this
channel encrypted too, at that cost.

The session: decode draws a random 32-byte secret per process and sends it in each reservation
(`Reservation.kv_session`), which reaches prefill only over the CURVE control channels (decode -> router ->
prefill), so only fleet members learn it. From it come two values that cannot be derived from each other:
    mac key  BLAKE3 derive_key("kvseal kv mac v1", secret)      tags every message: keyed BLAKE3 over each
                                                                frame's length (8 bytes, little endian) then
                                                                its bytes (32-byte tag, the last frame)
    token    BLAKE3 derive_key("kvseal kv connect v1", secret)  ZeroMQ PLAIN password (hex): decode's ZAP handler
                                                                lets a connection in only with it
The token crosses in clear at each connection: someone on the path can see it, and the KV bytes, and connect;
what they send still fails the MAC and is dropped, and they cannot forge an acknowledgement.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Sequence
from typing import Any

from blake3 import blake3

TAG_BYTES = 32


def new_session() -> str:
    return secrets.token_hex(32)


class KvMac:
    def __init__(self, session: str) -> None:
        try:
            secret = bytes.fromhex(session)
        except ValueError:
            secret = b""
        if len(secret) != 32:
            raise ValueError("a KV session is 32 random bytes as hex (Reservation.kv_session)")
        self._key = blake3(secret, derive_key_context="kvseal kv mac v1").digest()
        self.token = blake3(secret, derive_key_context="kvseal kv connect v1").hexdigest().encode()

    def tag(self, frames: Sequence[Any]) -> bytes:
        """The MAC of a message's frames (bytes, memoryviews or zmq.Frame buffers), lengths included."""
        h = blake3(key=self._key)
        for f in frames:
            view = memoryview(f).cast("B")
            h.update(view.nbytes.to_bytes(8, "little"))
            h.update(view)
        return h.digest()

    def check(self, frames: Sequence[Any], tag: Any) -> bool:
        return hmac.compare_digest(self.tag(frames), bytes(tag))

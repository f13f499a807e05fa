"""Authenticated-only framing of the ZeroMQ KV channel, the default with fleet keys: KV bytes cross in clear,
every message both ways carries a MAC, and only a holder of the session's token completes the connection.

Why not CURVE here: CURVE encrypts every byte in libzmq's one I/O thread per connection (XSalsa20-Poly1305 with
copies), which cut the ZeroMQ KV transfer to about half its speed (docs/benchmarks.md). A MAC is one keyed-hash
pass per side. The control channels and NIXL's offers stay CURVE (small messages, encrypted);
`--kv-channel curve` keeps this channel encrypted too, at that cost.

The session: decode draws a random 32-byte secret per process and sends it in each reservation
(`Reservation.kv_session`), which reaches prefill only over the CURVE control channels (decode -> router ->
prefill), so only fleet members learn it. From it come two values that cannot be derived from each other:
    mac key  HMAC-SHA256(secret, "kvseal kv mac v1")     tags every message: HMAC-SHA256 over each frame's
                                                          length (8 bytes, little endian) then its bytes
    token    HMAC-SHA256(secret, "kvseal kv connect v1")  ZeroMQ PLAIN password: decode's ZAP handler lets a
                                                          connection in only with it (nothing read otherwise)
The token crosses in clear at each connection: someone on the path can see it, and the KV bytes, and connect;
what they send still fails the MAC and is dropped, and they cannot forge an acknowledgement. HMAC-SHA256 and not
keyed BLAKE2b: with the SHA extensions (AMD Zen, Intel since Ice Lake) it runs at twice hashlib's BLAKE2b.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Sequence
from typing import Any

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
        self._key = hmac.digest(secret, b"kvseal kv mac v1", "sha256")
        self.token = hmac.digest(secret, b"kvseal kv connect v1", "sha256").hex().encode()

    def tag(self, frames: Sequence[Any]) -> bytes:
        """The MAC of a message's frames (bytes, memoryviews or zmq.Frame buffers), lengths included."""
        h = hmac.new(self._key, digestmod="sha256")
        for f in frames:
            view = memoryview(f)
            h.update(view.nbytes.to_bytes(8, "little"))
            h.update(view)
        return h.digest()

    def check(self, frames: Sequence[Any], tag: Any) -> bool:
        return hmac.compare_digest(self.tag(frames), bytes(tag))

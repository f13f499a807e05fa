"""A decode worker's reservation: the pages it set aside for one request, and the names that bind an arrival to it.

Decode hands it to the router, the router to prefill (inside a prefill request), and prefill's manifest must match
it before decode uses a page (seal 4, transfer/verify.py).
"""

from __future__ import annotations

import secrets

import msgspec

from kvseal.wire.kvspec import KVSpec

SCHEMA_VERSION = 1


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """Pages a decode worker set aside for one request. Decode keeps its own copy and verifies against it."""

    request_id: str
    reservation_id: str
    nonce: str  # 128-bit random hex; binds the arrival to this reservation (see new_nonce)
    num_tokens: int  # prompt tokens whose KV will arrive
    page_ids: list[int]  # decode's page ids, in token order; len == ceil(num_tokens / kv.page_size)
    kv: KVSpec  # decode's own KV spec: the manifest's must equal it (verify_identity)
    kv_endpoint: str  # where to send the pages, e.g. "tcp://127.0.0.1:5555"
    kv_key: str = ""  # the decode worker's fleet public key (Z85): prefill pins it; "" in a fleet without keys
    kv_session: str = ""  # decode's KV session (hex): the channel's MAC framing (transfer/kvmac.py); "": CURVE
    v: int = SCHEMA_VERSION


def new_nonce() -> str:
    return secrets.token_hex(16)


def new_reservation_id() -> str:
    return secrets.token_hex(8)

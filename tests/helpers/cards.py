"""A worker card to build tests from: a prefill worker of a fleet whose every field the test may change."""

from __future__ import annotations

import msgspec

from kvseal.wire.card import WorkerCard
from kvseal.wire.kvspec import KVSpec

KV = KVSpec(model_fingerprint="f", page_size=16, kv_dtype="float32", kv_layout="kt:L30xPx3x64xS")
CARD = WorkerCard(role="prefill", model="m", instance="i-1", kv=KV, kernels="native", arithmetic="fast/int8",
                  arithmetic_isa="avx2", kv_transport="zmq", tokenizer_digest="sha256:t", test_faults="",
                  model_window=8192, model_max_position=8192, context_window=4096, pool_pages=512, pool_tokens=8192,
                  kv_bytes_per_token=23040, kv_scrub=True, prefix_cache=True, fairness="vtc", device="cpu",
                  ledger=None, fleet_auth="off", reservation_timeout_s=None)


def card(**changes: object) -> WorkerCard:
    """CARD with `changes`, by the names /info uses: a KVSpec field (page_size=32) changes the card's kv."""
    kv = {k: changes.pop(k) for k in list(changes) if k in KVSpec.__struct_fields__}
    return msgspec.structs.replace(CARD, kv=msgspec.structs.replace(CARD.kv, **kv), **changes)

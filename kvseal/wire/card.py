"""What a disaggregated worker is, as it tells the router (InfoResp, at every heartbeat): its `WorkerCard`.

The card holds what stays fixed for the life of the worker process: its role and model, its KV spec (wire/kvspec.py),
how it computes and moves KV, its tokenizer and test faults, and its capacity. The router's fleet check (seal 7,
router/registry.py) reads every field it compares from here, typed: a card that lacks a field does not decode, so
no check ever runs on a default. What changes from step to step (free pages, requests, counters) is not on the
card (InfoResp.figures).

`to_json()` is the card as /info shows it: the KV spec's fields at the top level, beside the others.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvseal.wire.kvspec import KVSpec
from kvseal.wire.roles import Role


class WorkerCard(msgspec.Struct, frozen=True, kw_only=True):
    role: Role  # PREFILL or DECODE
    model: str  # the checkpoint's name
    instance: str  # new with every process start (identity.new_instance_id): another one is a new process
    kv: KVSpec  # what its KV is: prefill and decode must have equal ones
    kernels: str  # "native" or "torch"
    arithmetic: str  # the kernel set, e.g. "exact/native" or "fast/int8" (kernels/arithmetic.py)
    arithmetic_isa: str | None  # the CPU instructions the fast arithmetic uses (None: not chosen per CPU)
    kv_transport: str  # how KV moves between workers: "zmq" or "nixl" (--kv-transport)
    tokenizer_digest: str  # identity.tokenizer_digest: the router's must be the same
    test_faults: str  # --test-faults, canonical ("" for none): a fleet is all-clean or all on the same faults
    model_window: int  # tokens the model supports and the operator allows (--max-model-len)
    model_max_position: int  # the checkpoint's own limit
    context_window: int  # what this worker serves: model_window, or less when its pool holds less
    pool_pages: int
    pool_tokens: int  # pool_pages * kv.page_size: the longest sequence its pool can hold
    kv_bytes_per_token: int
    kv_scrub: bool  # freed pages are zeroed (seal 6)
    prefix_cache: bool
    fairness: str  # --fairness: "vtc" or "off"
    device: str
    ledger: str | None  # the forensic ledger's path (None: off)
    fleet_auth: str  # "curve" (fleet keys) or "off"
    reservation_timeout_s: float | None  # decode: how long a reservation waits for its KV; None for prefill

    def to_json(self) -> dict[str, Any]:
        """The card's part of /info, with the keys /info has always had (kvseal doctor and tests read them).
        reservation_timeout_s appears only where it is set (decode)."""
        out = msgspec.to_builtins(self)
        return {**{k: v for k, v in out.items() if k != "kv" and not (k == "reservation_timeout_s" and v is None)},
                **self.kv.fields()}

    @staticmethod
    def from_json(info: dict[str, Any]) -> WorkerCard:
        """The card in a worker's /info (to_json's inverse; other keys are ignored). Raises msgspec.ValidationError
        naming the first card field that is missing or of the wrong type (only reservation_timeout_s may be
        absent: a prefill worker's /info has none)."""
        kv = {k: info[k] for k in KVSpec.__struct_fields__ if k in info}
        return msgspec.convert({"reservation_timeout_s": None, **info, "kv": kv}, WorkerCard)

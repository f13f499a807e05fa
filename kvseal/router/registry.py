"""Seal 7: capacity and consistency of the fleet, checked before the router serves anything and at every join.

The served context window is the smallest any eligible worker can hold. The router refuses to start when a
worker's KV pool holds fewer tokens than that window, or when workers disagree on the model fingerprint, page
size, KV dtype, KV layout, kernels, arithmetic or KV transport. After start, the fleet as it started is a
`FleetSpec`, and a worker that connects, reconnects or registers must match it in full (`check_worker`), its
tokenizer and its test faults included, before it gets a request. Each message names both numbers and both fixes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvseal.errors import CapacityMismatch

# kernels/arithmetic: the kernel sets compute the same KV only up to rounding (exact) or quantization (fast);
# mixing them would make a disaggregated answer differ from a unified one, so the fleet agrees on one.
_MUST_MATCH = ("model_fingerprint", "page_size", "kv_dtype", "kv_layout", "kernels", "arithmetic")
# how KV moves between workers (--kv-transport); a worker of a version before the flag speaks zmq
_TRANSPORT, _DEFAULT_TRANSPORT = "kv_transport", "zmq"


def served_window(infos: list[tuple[str, dict[str, Any]]], max_model_len: int | None) -> int:
    """The window to serve: the router's --max-model-len, else the smallest model window of the fleet.

    infos: (worker name, its /info) for every worker that may receive a request.
    """
    if not infos:
        raise CapacityMismatch("no workers: start at least one prefill and one decode worker")
    model_windows = [int(i["model_window"]) for _, i in infos]
    window = min(model_windows)
    if max_model_len is not None:
        if max_model_len > window:
            name, info = min(infos, key=lambda x: int(x[1]["model_window"]))
            raise CapacityMismatch(
                f"--max-model-len {max_model_len} is larger than {name}'s model window of "
                f"{info['model_window']} tokens. Fix: lower --max-model-len to {info['model_window']} or less.")
        window = max_model_len
    return window


def check_fleet(infos: list[tuple[str, dict[str, Any]]], window: int) -> None:
    """Raise CapacityMismatch unless every worker can hold `window` tokens and all agree on the layout."""
    ref_name, ref = infos[0]
    for name, info in infos:
        _check_agree(ref_name, ref, name, info)
        _check_pool(name, info, window)


def _check_agree(ref_name: str, ref: Mapping[str, object], name: str, info: Mapping[str, object]) -> None:
    differ = [key for key in _MUST_MATCH if info[key] != ref[key]]
    if differ:
        theirs = ", ".join(f"{key}={info[key]!r}" for key in differ)
        ours = ", ".join(f"{key}={ref[key]!r}" for key in differ)
        raise CapacityMismatch(
            f"{name} has {theirs} but {ref_name} has {ours}: KV computed by one cannot be used by the "
            f"other. Fix: start every worker with the same model, --page-size, --dtype, --kv-dtype, --kernels "
            f"and --arithmetic.")
    theirs_t, ours_t = info.get(_TRANSPORT, _DEFAULT_TRANSPORT), ref.get(_TRANSPORT, _DEFAULT_TRANSPORT)
    if theirs_t != ours_t:
        raise CapacityMismatch(
            f"{name} moves KV with --kv-transport {theirs_t} but {ref_name} with --kv-transport {ours_t}: a prefill "
            f"worker can hand KV only to a decode worker of the same transport. Fix: start every worker with "
            f"--kv-transport {ours_t}, or every worker with --kv-transport {theirs_t}.")


def _check_pool(name: str, info: Mapping[str, Any], window: int) -> None:
    pool = int(info["pool_tokens"])
    if pool < window:
        raise CapacityMismatch(
            f"{name}: its KV pool holds {pool} tokens, fewer than the {window}-token context window the "
            f"router is to serve. A prompt between the two would not fit on that worker. Fix: raise that "
            f"worker's pool to at least {window} tokens (--kv-pool-tokens {window}), or lower the served "
            f"window to at most {pool} tokens (--max-model-len {pool}).")


@dataclass(frozen=True)
class FleetSpec:
    """What every worker must match to get requests: fixed when the router starts."""

    window: int  # the served context window
    agreed: Mapping[str, object]  # the _MUST_MATCH fields of the fleet the router started with
    tokenizer_digest: str  # the router's own tokenizer (identity.tokenizer_digest)
    test_faults: str  # the router's own --test-faults, canonical ("" for none)

    @staticmethod
    def of(infos: list[tuple[str, dict[str, Any]]], window: int, tokenizer_digest: str,
           test_faults: str) -> FleetSpec:
        agreed = {key: infos[0][1][key] for key in _MUST_MATCH}
        agreed[_TRANSPORT] = infos[0][1].get(_TRANSPORT, _DEFAULT_TRANSPORT)
        return FleetSpec(window, agreed, tokenizer_digest, test_faults)


def check_worker(name: str, role: str, info: dict[str, Any], spec: FleetSpec, capacity: bool = True) -> None:
    """Raise CapacityMismatch unless this worker may serve in the fleet `spec` describes, in the role `role`.
    capacity=False (the test-only incident fault) skips the window checks only."""
    if info.get("role") != role:
        raise CapacityMismatch(f"{name} is a {info.get('role')!r} worker, not a {role!r} one. Fix: give its "
                               f"endpoint as --{info.get('role')} (or start it as `kvseal {role}`).")
    missing = [key for key in (*_MUST_MATCH, "pool_tokens", "context_window", "tokenizer_digest", "test_faults")
               if key not in info]
    if missing:
        raise CapacityMismatch(f"{name} does not report {', '.join(missing)}: it runs another kvseal version. "
                               f"Fix: run one kvseal version on the router and every worker.")
    _check_agree("the fleet", spec.agreed, name, info)
    if capacity:
        _check_pool(name, info, spec.window)
    window = int(info["context_window"])
    if capacity and window < spec.window:
        raise CapacityMismatch(
            f"{name}: it serves a context window of {window} tokens, smaller than the {spec.window}-token window "
            f"the router serves. A prompt between the two would be refused there. Fix: start that worker with "
            f"--max-model-len {spec.window} (or without --max-model-len), or serve at most {window} tokens "
            f"(--max-model-len {window} on the router).")
    if info["tokenizer_digest"] != spec.tokenizer_digest:
        raise CapacityMismatch(
            f"{name} has tokenizer {info['tokenizer_digest']} but the router has {spec.tokenizer_digest}: the "
            f"router would tokenize prompts for another vocabulary. Fix: start the router and every worker with "
            f"the same model.")
    if info["test_faults"] != spec.test_faults:
        theirs, ours = info["test_faults"] or "none", spec.test_faults or "none"
        raise CapacityMismatch(
            f"{name} runs with test faults {theirs!r} but the router with {ours!r}: a fleet is all-clean or all "
            f"on the same test faults. Fix: start every process with the same --test-faults (or none).")

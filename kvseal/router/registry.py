"""Seal 7: capacity and consistency of the fleet, checked before the router serves anything.

The served context window is the smallest any eligible worker can hold. The router refuses to start (and
refuses to register a worker) when a worker's KV pool holds fewer tokens than that window, or when
workers disagree on the model fingerprint, page size, KV dtype, KV layout, kernels or arithmetic. Each message names both
numbers and both fixes.
"""

from __future__ import annotations

from typing import Any

from kvseal.errors import CapacityMismatch

# kernels/arithmetic: the kernel sets compute the same KV only up to rounding (exact) or quantization (fast);
# mixing them would make a disaggregated answer differ from a unified one, so the fleet agrees on one.
_MUST_MATCH = ("model_fingerprint", "page_size", "kv_dtype", "kv_layout", "kernels", "arithmetic")


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
        differ = [key for key in _MUST_MATCH if info[key] != ref[key]]
        if differ:
            theirs = ", ".join(f"{key}={info[key]!r}" for key in differ)
            ours = ", ".join(f"{key}={ref[key]!r}" for key in differ)
            raise CapacityMismatch(
                f"{name} has {theirs} but {ref_name} has {ours}: KV computed by one cannot be used by the "
                f"other. Fix: start every worker with the same model, --page-size, --dtype, --kv-dtype, --kernels "
                f"and --arithmetic.")
        pool = int(info["pool_tokens"])
        if pool < window:
            raise CapacityMismatch(
                f"{name}: its KV pool holds {pool} tokens, fewer than the {window}-token context window the "
                f"router is to serve. A prompt between the two would not fit on that worker. Fix: raise that "
                f"worker's pool to at least {window} tokens (--kv-pool-tokens {window}), or lower the served "
                f"window to at most {pool} tokens (--max-model-len {pool}).")

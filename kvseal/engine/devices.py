"""Where an engine computes and in what number types: --device, --dtype and --kv-dtype resolved."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_kv_dtype(kv_dtype: str, model_dtype: str, fast: bool) -> str:
    """--kv-dtype auto: bfloat16 under the fast arithmetic (its attention reads bfloat16 pages in place: half the
    bytes per decode step and per handoff, as vLLM's bf16 KV; docs/benchmarks.md has the cost in perplexity),
    otherwise the model's dtype (the exact arithmetic keeps float32 KV for its bit-for-bit reference)."""
    if kv_dtype != "auto":
        return kv_dtype
    return "bfloat16" if fast else model_dtype

"""Where an engine computes and in what number types: --device, --dtype and --kv-dtype resolved, with the kernels and
the arithmetic that go with them (`place`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvseal.config import EngineConfig
from kvseal.kernels.arithmetic import Arithmetic, resolve_arithmetic
from kvseal.kernels.build import resolve as resolve_kernels
from kvseal.model.checkpoint import Checkpoint

log = logging.getLogger("kvseal.engine")

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


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype  # the model's
    kv_dtype: torch.dtype  # the KV pool's
    kernels: str  # "native" or "torch"
    arithmetic: Arithmetic


def place(cfg: EngineConfig, ckpt: Checkpoint) -> Placement:
    """Resolve --device, --dtype, --kernels, --arithmetic and --kv-dtype for this checkpoint. ValueError (naming the
    flags and the fix) for a KV dtype the exact native kernels cannot read."""
    device, dtype = resolve_device(cfg.model.device), DTYPES[cfg.model.dtype]
    kernels, why = resolve_kernels(cfg.model.kernels, device.type, cfg.model.dtype, ckpt.arch)
    arithmetic = resolve_arithmetic(cfg.model.arithmetic, kernels, why, ckpt.arch, cfg.cache.page_size,
                                    ckpt.block_types())
    log.info("arithmetic: %s%s (%s)", arithmetic.name, f" on {arithmetic.isa}" if arithmetic.isa else "",
             arithmetic.why)
    kv_dtype = DTYPES[resolve_kv_dtype(cfg.cache.kv_dtype, cfg.model.dtype, arithmetic.fast)]
    if kv_dtype != dtype and not arithmetic.fast and kernels == "native":
        raise ValueError(f"--kv-dtype {cfg.cache.kv_dtype} with --dtype {cfg.model.dtype} needs the fast "
                         "arithmetic or --kernels torch (the exact native kernels read float32 KV). Fix: "
                         "--arithmetic fast, or drop --kv-dtype")
    return Placement(device, dtype, kv_dtype, kernels, arithmetic)

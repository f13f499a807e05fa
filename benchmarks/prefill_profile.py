"""Where a long prompt's prefill time goes, per op, for each arithmetic: the "before and after" of issue 8.

    python -m benchmarks.prefill_profile --prompt-len 2000 --threads 2 --repeats 3 [--model M.gguf]

For each arithmetic (`exact`, the float32 set that was the default before, and `fast`), one in-process engine
(512-token chunks) prefills the same random prompt with max_tokens=1:
- "one call": the product path (for `fast`, every layer of a step in one C call), median of --repeats;
- "per op": the same prompt through the op-by-op path with a timer around every op (matrix products,
  attention, KV write, norms, RoPE, SwiGLU), so the split is measured, not estimated; the rest (embedding,
  sampling, scheduling, page tables) is the difference to the step's wall time.
Matrix products and attention also get their multiply-adds and rate (GMAC/s), to set against the instruction
peaks of `python -m benchmarks.limits`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from kvseal import LLM, SamplingParams
from kvseal.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvseal.engine.engine import Engine
from kvseal.kernels import ops
from kvseal.model import llama
from kvseal.model.loader import load_checkpoint

OPS = ("rms_norm", "rope_", "write_kv", "paged_attention_kt", "paged_attention", "silu_mul")


def prefill_s(e: Engine, ids: list[int]) -> float:
    t = time.perf_counter()
    LLM.from_engine(e).generate(ids, SamplingParams(max_tokens=1, temperature=0.0))
    return time.perf_counter() - t


class Timers:
    """Wraps the model module's `linear` and the ops it calls; seconds and multiply-adds per op name."""

    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)
        self.macs: dict[str, float] = defaultdict(float)
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, label: str, macs: Callable[..., float] | None = None) -> None:
        f = getattr(owner, name)

        def timed(*args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            out = f(*args, **kw)
            self.s[label] += time.perf_counter() - t
            if macs is not None:
                self.macs[label] += macs(*args, out=out)
            return out

        self._undo.append((owner, name, f))
        setattr(owner, name, timed)

    def undo(self) -> None:
        for owner, name, f in reversed(self._undo):
            setattr(owner, name, f)


def linear_macs(x: torch.Tensor, w: Any, *_: Any, out: torch.Tensor) -> float:
    return float(x.shape[0] * x.shape[-1] * out.shape[-1])  # rows x inputs x outputs


def profile(e: Engine, ids: list[int], model_args: tuple[int, int, int]) -> tuple[float, Timers]:
    layers, heads, head_dim = model_args
    timers = Timers()
    timers.wrap(llama, "linear", "matrix products", linear_macs)
    for name in OPS:
        if hasattr(ops, name):
            timers.wrap(ops, name, "attention" if name.startswith("paged_attention") else name)
    llama_paged = getattr(llama, "paged_attention", None)
    if llama_paged is not None:
        timers.wrap(llama, "paged_attention", "attention")
    saved = e.model._c_fast, getattr(e.model, "_c_layers", None)
    e.model._c_fast = None  # the op-by-op path: same ops, one Python call each
    if hasattr(e.model, "_c_layers"):
        e.model._c_layers = None
    try:
        wall = prefill_s(e, ids)
    finally:
        e.model._c_fast, c_layers = saved
        if hasattr(e.model, "_c_layers"):
            e.model._c_layers = c_layers
        timers.undo()
    n = len(ids)
    # causal attention over the prompt: QK^T and PV, each heads x head_dim x n(n+1)/2 multiply-adds per layer
    timers.macs["attention"] = 2.0 * layers * heads * head_dim * n * (n + 1) / 2
    return wall, timers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefill_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file or a model folder (default: the bundled model)")
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--arithmetics", default="exact,fast")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    ops.match_torch_threads()  # the kernels' OpenMP threads = torch's
    ckpt = load_checkpoint(a.model)
    arch = ckpt.arch
    ids = [random.Random(0).randrange(1000, 20000) for _ in range(a.prompt_len)]
    window = max(4096, a.prompt_len + 16)
    print(f"{a.prompt_len}-token prompt, 512-token chunks, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for arith in a.arithmetics.split(","):
        e = Engine(EngineConfig(model=ModelConfig(max_model_len=window, arithmetic=arith),
                                cache=CacheConfig(pool_tokens=window, prefix_cache=False),  # every run computes
                                scheduler=SchedulerConfig(max_num_batched_tokens=512)), ckpt)
        prefill_s(e, ids[:64])
        one_call = statistics.median(prefill_s(e, ids) for _ in range(a.repeats))
        wall, t = profile(e, ids, (arch.num_layers, arch.num_heads, arch.head_dim))
        print(f"\n{arith}: "
              f"one call {one_call:.2f} s ({a.prompt_len / one_call:,.0f} tok/s); per op {wall:.2f} s")
        rest = wall - sum(t.s.values())
        for label, s in sorted(t.s.items(), key=lambda kv: -kv[1]):
            rate = f"  {t.macs[label] / 1e9:6.1f} GMAC at {t.macs[label] / s / 1e9:6.1f} GMAC/s" if t.macs.get(
                label) else ""
            print(f"  {label:18s} {s:6.3f} s {100 * s / wall:5.1f}%{rate}")
        print(f"  {'the rest':18s} {rest:6.3f} s {100 * rest / wall:5.1f}%  (embedding, sampling, scheduling)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the prefix cache costs when nothing is shared, and what it saves when prompts share a head; in one run.

    python -m benchmarks.prefix_cost             # 32 requests x (256 prompt + 64 new), 5 interleaved repeats

Measured in-process on one engine (no HTTP), the cache on against --no-prefix-cache:
  no sharing  every prompt is new (fresh random ids in every repeat), so the cache only costs: hashing the
              prompt, caching its full pages, evicting (and scrubbing) the least recently used ones when the pool
              runs short. The pool holds one repeat's worth, so from the second repeat on every page comes back
              through eviction. Target: the cache on is within 5% of off.
  sharing     the same prompts with a common head of --shared-len tokens (a system prompt, a few-shot template):
              the share of output tok/s and of the time to the first tokens that the cache buys.
Repeats alternate on/off so that machine noise hits both; figures are medians, ratios are per repeat pair.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine_info
from benchmarks.seal_cost import run_workload
from kvseal import LLM, SamplingParams
from kvseal.config import CacheConfig, EngineConfig, ModelConfig
from kvseal.engine.engine import Engine
from kvseal.model.loader import load_checkpoint


def prefill_seconds(engine: Engine, prompts: list[list[int]], tag: str) -> float:
    """Seconds until every prompt has its first token (max_tokens=1: prefill only)."""
    t0 = time.perf_counter()
    LLM.from_engine(engine).generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefix_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--shared-len", type=int, default=192, help="the common head of the sharing workload")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench_out/prefix_cost.json")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    ckpt = load_checkpoint(None)
    rng = random.Random(0)

    def fresh(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(1000, 20000) for _ in range(length)] for _ in range(n)]

    def engine(cache: bool) -> Engine:
        tokens = a.requests * (a.prompt_len + a.new_tokens) + 1024  # one repeat's worth: later ones evict
        return Engine(EngineConfig(cache=CacheConfig(pool_tokens=tokens, prefix_cache=cache),
                                   model=ModelConfig(max_model_len=a.prompt_len + a.new_tokens + 16)), ckpt)

    on, off = engine(True), engine(False)
    warm = fresh(2, a.prompt_len)
    for e in (on, off):
        run_workload(e, warm, 4, "warm")
    none: list[tuple[float, float]] = []  # (on, off) output tok/s, nothing shared
    for r in range(a.repeats):
        prompts = fresh(a.requests, a.prompt_len)
        order = (on, off) if r % 2 == 0 else (off, on)
        got = {id(e): run_workload(e, prompts, a.new_tokens, f"n{r}{i}") for i, e in enumerate(order)}
        none.append((got[id(on)], got[id(off)]))
        print(f"no sharing, repeat {r}: cache on {none[-1][0]:.1f} tok/s, off {none[-1][1]:.1f} tok/s", flush=True)
    shared: list[tuple[float, float]] = []  # (on, off) seconds to all first tokens, common head
    for r in range(a.repeats):
        head = fresh(1, a.shared_len)[0]
        prompts = [head + tail for tail in fresh(a.requests, a.prompt_len - a.shared_len)]
        order = (on, off) if r % 2 == 0 else (off, on)
        got = {id(e): prefill_seconds(e, prompts, f"s{r}{i}") for i, e in enumerate(order)}
        shared.append((got[id(on)], got[id(off)]))
        print(f"sharing, repeat {r}: first tokens after {shared[-1][0]:.2f} s with the cache, "
              f"{shared[-1][1]:.2f} s without", flush=True)
    on.allocator.check_integrity()
    result: dict[str, Any] = {
        "workload": {"requests": a.requests, "prompt_len": a.prompt_len, "shared_len": a.shared_len,
                     "new_tokens": a.new_tokens, "threads": torch.get_num_threads()},
        "no_sharing_on_tok_s": statistics.median(x for x, _ in none),
        "no_sharing_off_tok_s": statistics.median(y for _, y in none),
        "no_sharing_on_over_off": statistics.median(x / y for x, y in none),
        "sharing_prefill_s_on": statistics.median(x for x, _ in shared),
        "sharing_prefill_s_off": statistics.median(y for _, y in shared),
        "sharing_speedup": statistics.median(y / x for x, y in shared),
        "evicted_pages": on.prefix_cache.evicted_pages,
        "runs": {"no_sharing": none, "sharing": shared}, "machine": machine_info(),
    }
    print(f"no sharing: cache on {result['no_sharing_on_tok_s']:.1f} tok/s, off {result['no_sharing_off_tok_s']:.1f} "
          f"tok/s, ratio {result['no_sharing_on_over_off']:.3f} (median of {a.repeats} pairs; "
          f"{result['evicted_pages']} pages evicted)")
    print(f"sharing ({a.shared_len} of {a.prompt_len} tokens): all first tokens after "
          f"{result['sharing_prefill_s_on']:.2f} s with the cache, {result['sharing_prefill_s_off']:.2f} s without "
          f"({result['sharing_speedup']:.2f}x)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

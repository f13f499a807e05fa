"""Prefill speed of one long prompt against the chunk size (the scheduler's per-step token budget).

    python -m benchmarks.prefill_chunks --prompt-len 2000 --budgets 512,2048 --repeats 2 --threads 2

One in-process engine per budget, the same random prompt, max_tokens=1; the budgets alternate within each
repeat so that machine noise hits all of them. Prints prompt tokens / time to the first token.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from kvseal.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvseal.engine.engine import Engine
from kvseal.model.loader import load_checkpoint
from kvseal.wire.messages import GenerateRequest, SamplingParams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefill_chunks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--budgets", default="512,2048")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    ckpt = load_checkpoint(None)
    ids = [random.Random(0).randrange(1000, 20000) for _ in range(a.prompt_len)]
    window = max(4096, a.prompt_len + 16)
    engines = {b: Engine(EngineConfig(model=ModelConfig(max_model_len=window), cache=CacheConfig(pool_tokens=window),
                                      scheduler=SchedulerConfig(max_num_batched_tokens=b)), ckpt)
               for b in (int(x) for x in a.budgets.split(","))}
    for rep in range(a.repeats):
        for budget, e in engines.items():
            t = time.perf_counter()
            e.add_request(GenerateRequest(f"r{rep}", ids, SamplingParams(max_tokens=1, temperature=0.0)))
            while e.has_work():
                e.step()
            print(f"repeat {rep}, chunks of {budget}: {a.prompt_len / (time.perf_counter() - t):.0f} tok/s",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

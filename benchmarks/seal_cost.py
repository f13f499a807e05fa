"""What the seals cost: the same workload with kvseal's runtime checks on and off, in one run.

    python -m benchmarks.seal_cost                 # 32 requests x (128 prompt + 128 new), 5 interleaved repeats
    python -m benchmarks.seal_cost --compare ledger   # the forensic ledger on vs off (both sealed)

Measured in-process on one engine (no HTTP, so the checks are not hidden behind other overhead):
  engine   output tok/s of the whole workload with scrub (seal 6) and the per-step ownership check (seal 5) on,
           against both off (the engine built with scrub=False, and the runner's check replaced by "no
           violations" in this benchmark only: kvseal itself has no switch to turn seal 5 off);
  handoff  the checksums of a handoff (seal 4: xxh3 over every page, computed by prefill and again by decode)
           against the prefill compute of the same prompt: the share of a request's prefill time they add.
With --compare ledger the two engines are both sealed and differ only in the forensic ledger (kvseal/ledger: page
provenance per step, one SQLite row per ended request); the handoff share is not measured then.
Repeats alternate on/off so that machine noise hits both; figures are medians, the ratio is per repeat pair.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine_info
from kvseal import llm as api
from kvseal.config import CacheConfig, EngineConfig, LedgerConfig, ModelConfig
from kvseal.engine.engine import Engine
from kvseal.kv.allocator import pages_for
from kvseal.model.loader import load_checkpoint
from kvseal.transfer.manifest import pack_pages, page_checksums
from kvseal.wire.messages import GenerateRequest, SamplingParams


def run_workload(engine: Engine, prompts: list[list[int]], new_tokens: int, tag: str) -> float:
    """Output tok/s of all prompts run concurrently to the end."""
    t0 = time.perf_counter()
    outs = api.LLM.from_engine(engine).generate(prompts, api.SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                                         ignore_eos=True))
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def handoff_share(engine: Engine, prompt: list[int]) -> tuple[float, float]:
    """(checksum seconds for both sides, prefill seconds) for one prompt of this length."""
    t0 = time.perf_counter()
    engine.add_request(GenerateRequest("handoff", prompt, SamplingParams(max_tokens=2, temperature=0.0)))  # pages held
    seq = engine.seqs["handoff"]
    while seq.num_computed < len(prompt):
        engine.step()
    t_prefill = time.perf_counter() - t0
    payload = pack_pages(engine.pool.k, engine.pool.v, seq.pages[: pages_for(len(prompt), engine.pool.page_size)])
    assert payload.num_pages > 0
    t1 = time.perf_counter()
    page_checksums(payload)  # prefill computes them into the manifest ...
    page_checksums(payload)  # ... decode recomputes them before it uses a byte
    t_sums = time.perf_counter() - t1
    while engine.has_work():
        engine.step()
    return t_sums, t_prefill


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.seal_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compare", choices=["seals", "ledger"], default="seals",
                   help="seals: scrub and the ownership check on vs off; ledger: the forensic ledger on vs off")
    p.add_argument("--out", default=None, help="default: bench_out/seal_cost.json (ledger_cost.json)")
    a = p.parse_args(argv)
    if a.compare == "ledger":
        return compare_ledger(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    ckpt = load_checkpoint(None)
    prompts = workload(a)

    def engine(sealed: bool) -> Engine:
        tokens = a.requests * (a.prompt_len + a.new_tokens) + 1024
        e = Engine(EngineConfig(model=ModelConfig(dtype=a.dtype),
                                cache=CacheConfig(pool_tokens=tokens, scrub=sealed)), ckpt)
        if not sealed:  # benchmark-only: the ownership check reports nothing and costs nothing
            e.runner.check_ownership = lambda batch: []  # type: ignore[method-assign]
        return e

    on = engine(True)
    runs = interleaved(on, engine(False), prompts, a.new_tokens, a.repeats)
    sums, prefill = zip(*(handoff_share(on, prompts[i % len(prompts)]) for i in range(a.repeats)))
    result = summary(a, runs, "sealed", "unsealed")
    result["checksum_s_per_handoff"] = statistics.median(sums)
    result["prefill_s_per_prompt"] = statistics.median(prefill)
    result["checksum_share_of_prefill"] = result["checksum_s_per_handoff"] / result["prefill_s_per_prompt"]
    print(f"engine: sealed {result['sealed_tok_s']:.1f} tok/s, unsealed {result['unsealed_tok_s']:.1f} tok/s, "
          f"ratio {result['sealed_over_unsealed']:.3f} (median of {a.repeats} pairs)")
    print(f"handoff: checksums {result['checksum_s_per_handoff'] * 1e3:.2f} ms (both sides) for a "
          f"{a.prompt_len}-token prompt whose prefill took {result['prefill_s_per_prompt'] * 1e3:.0f} ms "
          f"({result['checksum_share_of_prefill']:.2%})")
    _save(a.out or "bench_out/seal_cost.json", result)
    return 0


def summary(a: argparse.Namespace, runs: tuple[list[tuple[float, float]], list[tuple[float, float]]], on: str,
            off: str) -> dict[str, Any]:
    """The workload, the median tok/s of each side, the median of the per-pair ratios, and the median per-pair
    ratio of CPU seconds (on / off: above 1 is what `on` costs)."""
    pairs, cpu = runs
    return {"workload": {"requests": a.requests, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                         "dtype": a.dtype, "threads": torch.get_num_threads()},
            f"{on}_tok_s": statistics.median(x for x, _ in pairs),
            f"{off}_tok_s": statistics.median(y for _, y in pairs),
            f"{on}_over_{off}": statistics.median(x / y for x, y in pairs),
            f"{on}_cpu_s_over_{off}": statistics.median(x / y for x, y in cpu), "runs": pairs, "cpu_s": cpu,
            "machine": machine_info()}


def workload(a: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, 20000) for _ in range(a.prompt_len)] for _ in range(a.requests)]


def _save(out: str, result: dict[str, Any]) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))


def interleaved(on: Engine, off: Engine, prompts: list[list[int]], new_tokens: int,
                repeats: int) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(on, off) output tok/s per repeat, the order alternating so that machine noise hits both; and (on, off)
    CPU seconds of this process per repeat (every thread: the engine's, torch's and the ledger writer's), which
    other processes on a shared machine disturb far less than wall time."""
    run_workload(on, prompts[:2], 4, "warm")
    run_workload(off, prompts[:2], 4, "warm")
    pairs: list[tuple[float, float]] = []
    cpu: list[tuple[float, float]] = []
    for r in range(repeats):
        first, second = ((on, off) if r % 2 == 0 else (off, on))
        c0 = time.process_time()
        x = run_workload(first, prompts, new_tokens, f"r{r}a")
        c1 = time.process_time()
        y = run_workload(second, prompts, new_tokens, f"r{r}b")
        c2 = time.process_time()
        pairs.append((x, y) if first is on else (y, x))
        cpu.append((c1 - c0, c2 - c1) if first is on else (c2 - c1, c1 - c0))
        print(f"repeat {r}: on {pairs[-1][0]:.1f} tok/s {cpu[-1][0]:.1f} cpu-s, off {pairs[-1][1]:.1f} tok/s "
              f"{cpu[-1][1]:.1f} cpu-s", flush=True)
    return pairs, cpu


def compare_ledger(a: argparse.Namespace) -> int:
    """The forensic ledger's cost: two sealed engines, one writing a ledger, the same workload interleaved."""
    if a.threads:
        torch.set_num_threads(a.threads)
    ckpt = load_checkpoint(None)
    prompts = workload(a)
    tokens = a.requests * (a.prompt_len + a.new_tokens) + 1024
    with tempfile.TemporaryDirectory(prefix="kvseal-ledger-cost-") as tmp:
        on, off = (Engine(EngineConfig(model=ModelConfig(dtype=a.dtype), cache=CacheConfig(pool_tokens=tokens),
                                       ledger=LedgerConfig(path)), ckpt)
                   for path in (f"{tmp}/ledger.sqlite", None))
        runs = interleaved(on, off, prompts, a.new_tokens, a.repeats)
        assert on.ledger is not None
        on.ledger.close()
        rows = on.ledger.written
    result = summary(a, runs, "ledger_on", "ledger_off")
    result["ledger_rows_written"] = rows
    print(f"ledger: on {result['ledger_on_tok_s']:.1f} tok/s, off {result['ledger_off_tok_s']:.1f} tok/s, "
          f"ratio {result['ledger_on_over_ledger_off']:.3f}; "
          f"CPU seconds on/off {result['ledger_on_cpu_s_over_ledger_off']:.3f} "
          f"(medians of {a.repeats} pairs; {rows} rows written)")
    _save(a.out or "bench_out/ledger_cost.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

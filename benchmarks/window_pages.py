"""KV a long sequence holds when sliding-window layers keep only their window (kvseal/kv/window.py), against every
page kept (--no-window-pages), on one model, one greedy request, in one process.

    python -m benchmarks.window_pages --model ~/.cache/kvseal/models/gemma-3-270m-q4_k_m.gguf --prompt 2000 --new 32
    python -m benchmarks.window_pages --model tests-tiny-gemma3   # a tiny random Gemma 3 (needs transformers)

For each setting: after the request's last step, the pages it holds in each pool and their bytes; the most window
pages it held at once; pages dropped; the pools' sizes in bytes; whether both settings gave the same tokens; and the
pools back at their baseline once it ended (seal 8).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

import torch

from benchmarks import cpu_record
from kvseal.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvseal.engine.engine import Engine
from kvseal.kv.allocator import pages_for
from kvseal.kv.window import split_pages, split_window
from kvseal.model.checkpoint import Checkpoint
from kvseal.model.loader import load_checkpoint
from kvseal.wire.messages import GenerateRequest, SamplingParams


def run(ck: Checkpoint, prompt: list[int], new: int, window_pages: bool, arithmetic: str,
        page_size: int) -> dict[str, Any]:
    served = len(prompt) + new
    e = Engine(EngineConfig(model=ModelConfig(arithmetic=arithmetic, max_model_len=served),
                            cache=CacheConfig(page_size=page_size, pool_tokens=served + page_size,
                                              window_pages=window_pages),
                            scheduler=SchedulerConfig(max_num_batched_tokens=512)), ck)
    e.add_request(GenerateRequest("long", prompt, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)))
    out: list[int] = []
    held: tuple[int, int] = (0, 0)
    most_window = 0
    while e.has_work():
        for d in e.step():
            out += d.token_ids
            if d.error is not None:
                raise SystemExit(f"the request failed: {d.error.message}")
        seq = e.seqs.get("long")
        if seq is not None:
            held = (len(seq.pages), len(seq.window_pages))
            most_window = max(most_window, len(seq.window_pages))
    w = e.window
    wbytes = 0 if w is None else w.pool.page_bytes
    e.allocator.check_integrity()
    baseline = e.allocator.num_free == e.pool.num_pages
    if w is not None:
        w.allocator.check_integrity()
        baseline = baseline and w.allocator.num_free == w.pool.num_pages
    return {
        "window_pages": window_pages, "arithmetic": e.arithmetic.name, "tokens": out,
        "layers_main": int(e.pool.k.shape[0]), "layers_window": 0 if w is None else int(w.pool.k.shape[0]),
        "pages_main": held[0], "pages_window": held[1], "most_pages_window": most_window,
        "bytes_held": held[0] * e.pool.page_bytes + held[1] * wbytes,
        "pages_dropped": 0 if w is None else w.pages_dropped,
        "pool_bytes": e.pool.nbytes + (0 if w is None else w.pool.nbytes), "baseline": baseline,
    }


def tiny_gemma3() -> Checkpoint:
    from tests.helpers.tiny_models import make_tiny_arch

    return load_checkpoint(make_tiny_arch(tempfile.mkdtemp(), "gemma3"), progress=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a checkpoint with sliding-window layers, or tests-tiny-gemma3")
    p.add_argument("--prompt", type=int, default=2000, help="prompt tokens (random ids)")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--arithmetic", default="exact")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    ck = tiny_gemma3() if a.model == "tests-tiny-gemma3" else load_checkpoint(a.model, progress=False)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, min(ck.arch.vocab_size, 20000), (a.prompt,), generator=g).tolist()
    rows = [run(ck, prompt, a.new, wp, a.arithmetic, a.page_size) for wp in (False, True)]
    kept, window = rows
    print(cpu_record.header(cpu_record.collect()))
    print(f"model {ck.name}: {a.prompt} prompt + {a.new} new tokens, pages of {a.page_size}, {kept['arithmetic']}")
    for r in rows:
        print(f"  window pages {'on ' if r['window_pages'] else 'off'}: main pool {r['pages_main']} pages x "
              f"{r['layers_main']} layers, window pool {r['pages_window']} pages x {r['layers_window']} layers "
              f"(most after a step {r['most_pages_window']}, dropped {r['pages_dropped']}); KV held "
              f"{r['bytes_held'] / 2**20:.1f} MiB; pools {r['pool_bytes'] / 2**20:.1f} MiB; baseline after: "
              f"{r['baseline']}")
    ratio = window["bytes_held"] / kept["bytes_held"]
    print(f"  same tokens: {kept['tokens'] == window['tokens']}; KV held {ratio:.3f}x")
    # the pool a worker gets by default (2 x the model's window), in the same bytes, split as the engine splits it
    windows = ck.arch.windows(ck.arch.max_position)
    slid = sum(1 for w in windows if w)
    sched = SchedulerConfig()
    pages = 2 * ck.arch.max_position // a.page_size
    main, wpages = split_pages(pages, ck.arch.num_layers - slid, slid, split_window(windows), a.page_size,
                               sched.max_num_seqs, sched.max_num_batched_tokens,
                               sched.max_num_seqs * pages_for(ck.arch.max_position, a.page_size))
    print(f"  default pool ({2 * ck.arch.max_position} tokens of every layer, {sched.max_num_seqs} sequences): main "
          f"pool {main} pages, window pool {wpages} pages in the same bytes: {main / pages:.2f}x the positions")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_record.collect(), "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How far the fast arithmetic is from the exact one: greedy agreement and perplexity, in one process.

    python -m benchmarks.agreement                         # 50 prompts x 64 tokens, a 2,048-token text
    python -m benchmarks.agreement --prompts 100 --kv-dtype float32,bfloat16 --json out.json
    python -m benchmarks.agreement --model ~/.cache/kvseal/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

--model takes any checkpoint kvseal loads (a GGUF file, a Hugging Face folder); the default is the bundled model.

For each arithmetic (exact float32 is the reference; fast with each --kv-dtype):
  - greedy: the same prompts (chat questions and random-token prompts), 64 new tokens each; per prompt, how many
    tokens equal the reference's before the first difference (median, mean, and how many prompts agree fully);
  - perplexity: one fixed text of at least 2,000 tokens (stdlib docstrings: TEXT_SOURCES) scored teacher-forced
    in 512-token chunks through the engine's own paged path (every position's next-token log-probability),
    exp(mean negative log-likelihood), and its ratio to the reference's (target: within 1%).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import statistics
import time
from typing import Any

import torch

from benchmarks import cpu_record
from kvseal import llm as api
from kvseal.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvseal.engine.engine import Engine
from kvseal.engine.scheduler import Batch
from kvseal.engine.sequence import Sequence
from kvseal.kv.allocator import pages_for
from kvseal.model.checkpoint import Checkpoint
from kvseal.model.detokenize import IncrementalDecoder
from kvseal.model.loader import load_checkpoint
from kvseal.wire.messages import GenerateRequest, SamplingParams

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.", "What is 12 times 12?",
    "Write a haiku about the sea.", "List three facts about the moon.", "How do I reverse a list in Python?",
    "Why is the sky blue?", "Give me a synonym for happy.", "What causes rain?", "Name three primary colors.",
    "Translate 'good morning' into Spanish.", "What is a prime number?", "Describe a cat to a child.",
    "How many legs does a spider have?", "What is the boiling point of water?", "Who wrote Romeo and Juliet?",
    "Summarize the plot of Cinderella.", "What is gravity?", "Suggest a name for a pet goldfish.",
    "How does a bicycle work?", "What is the largest planet?", "Write a short thank-you note.",
    "What is an atom?", "Why do leaves change color?", "Tell me a fun fact about octopuses.",
]

# The perplexity text: English prose that ships with every Python 3.11, the docstrings of these stdlib objects,
# in this order (about 4,700 tokens; the first --text-tokens are scored).
TEXT_SOURCES = ("json", "argparse", "difflib.SequenceMatcher", "difflib.Differ", "heapq", "doctest",
                "textwrap.TextWrapper", "string", "pickle", "calendar")


def perplexity_text() -> str:
    parts = []
    for name in TEXT_SOURCES:
        module, _, attr = name.partition(".")
        obj = importlib.import_module(module)
        parts.append(inspect.getdoc(getattr(obj, attr) if attr else obj) or "")
    return "\n\n".join(parts)


def _engine(ck: Checkpoint, arithmetic: str, kv_dtype: str, window: int) -> Engine:
    return Engine(EngineConfig(model=ModelConfig(arithmetic=arithmetic, max_model_len=window),
                               cache=CacheConfig(page_size=16, pool_tokens=4 * window, kv_dtype=kv_dtype),
                               scheduler=SchedulerConfig(max_num_batched_tokens=512)), ck)


def greedy(e: Engine, prompts: list[list[int]], new: int) -> list[list[int]]:
    outs = api.LLM.from_engine(e).generate(prompts, api.SamplingParams(max_tokens=new, temperature=0.0,
                                                                         ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def score(e: Engine, ids: list[int], chunk: int = 512) -> list[float]:
    """log p(ids[t + 1] | ids[: t + 1]) for every t, teacher-forced through the engine's paged path."""
    seq = Sequence(GenerateRequest("score", ids, SamplingParams(max_tokens=1)), e.allocator.new_owner(),
                   IncrementalDecoder(e.tokenizer), 0)
    seq.pages = e.allocator.allocate(seq.owner, pages_for(len(ids), e.pool.page_size))
    if e.window is not None and not e.window.grow(seq, len(ids)):  # sliding layers' own pool (kvseal/kv/window.py)
        raise RuntimeError("the window pool cannot hold the scored text: raise the pool")
    lps: list[float] = []
    try:
        for start in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - start)
            batch = Batch()
            batch.add(seq, n)
            res = e.runner.run(batch, all_logits=True)
            assert res.logits is not None and not res.violations
            e.scheduler.drop_out_of_window(seq)
            logp = torch.log_softmax(res.logits.double(), -1)
            targets = ids[start + 1 : start + n + 1]
            lps += logp[torch.arange(len(targets)), torch.tensor(targets)].tolist()
    finally:
        e.allocator.free_all(seq.owner.key)
        if e.window is not None:
            e.window.release(seq)
    return lps


def prefix_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.agreement", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: the bundled model)")
    p.add_argument("--prompts", type=int, default=50, help="greedy prompts (half chat questions, half random ids)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--text-tokens", type=int, default=2048, help="length of the perplexity text (>= 2000)")
    p.add_argument("--kv-dtype", default="float32,bfloat16", help="KV dtypes to run the fast arithmetic with")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    ck = load_checkpoint(a.model)
    tok = ck.tokenizer
    # a base model without a chat template (Gemma 3 270M) is asked the questions as plain text
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
             if tok.chat_template else tok.encode(q) for q in QUESTIONS]
    g = torch.Generator().manual_seed(0)
    prompts = [chats[i % len(chats)] if i % 2 == 0 else torch.randint(1000, 20000, (64,), generator=g).tolist()
               for i in range(a.prompts)]
    text_ids = tok.encode(perplexity_text(), add_special_tokens=False)[: a.text_tokens]
    if len(text_ids) < 2000:
        p.error(f"the perplexity text has {len(text_ids)} tokens; score at least 2,000")
    window = max(4096, a.text_tokens + 16)

    runs: list[dict[str, Any]] = []
    ref_tokens: list[list[int]] = []
    ref_ppl = float("nan")
    for arithmetic, kv in [("exact", "float32")] + [("fast", k) for k in a.kv_dtype.split(",")]:
        e = _engine(ck, arithmetic, kv, window)
        t = time.perf_counter()
        toks = greedy(e, prompts, a.new_tokens)
        lps = score(e, text_ids)
        ppl = math.exp(-statistics.fmean(lps))
        row: dict[str, Any] = {"arithmetic": e.arithmetic.name, "isa": e.arithmetic.isa, "kv_dtype": kv,
                               "perplexity": ppl, "seconds": time.perf_counter() - t}
        if arithmetic == "exact":
            ref_tokens, ref_ppl = toks, ppl
        else:
            agree = [prefix_agreement(x, y) for x, y in zip(toks, ref_tokens)]
            row.update(agree_median=statistics.median(agree), agree_mean=statistics.fmean(agree),
                       agree_full=sum(n == a.new_tokens for n in agree), prompts=len(agree),
                       perplexity_ratio=ppl / ref_ppl)
        runs.append(row)
        print(json.dumps(row), flush=True)

    cpu = cpu_record.collect()
    print(f"\n{cpu_record.header(cpu)}\nmodel {ck.name} ({a.model or 'bundled'}); {a.prompts} prompts x "
          f"{a.new_tokens} tokens; perplexity text {len(text_ids)} tokens")
    print("| arithmetic | KV dtype | greedy tokens equal to exact before the first difference (median / mean) "
          "| prompts fully equal | perplexity | vs exact |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        if "agree_median" in r:
            print(f"| {r['arithmetic']} ({r['isa']}) | {r['kv_dtype']} | {r['agree_median']:.0f} / "
                  f"{r['agree_mean']:.1f} of {a.new_tokens} | {r['agree_full']} of {r['prompts']} | "
                  f"{r['perplexity']:.3f} | {100 * (r['perplexity_ratio'] - 1):+.2f}% |")
        else:
            print(f"| {r['arithmetic']} (reference) | {r['kv_dtype']} | - | - | {r['perplexity']:.3f} | - |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu, "model": ck.name, "runs": runs, "prompts": a.prompts, "new_tokens": a.new_tokens,
                       "text_tokens": len(text_ids)}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

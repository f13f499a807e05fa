"""How far bf16 greedy output agrees with fp32 (which equals transformers token for token, see
tests/e2e/test_correctness.py).  `python -m benchmarks.bf16_agreement [--new-tokens 64]`

For each prompt: the index of the first token where bf16 departs from fp32, and the share of positions
before any departure (after a departure the two continue from different text, so later positions are not
comparable)."""

from __future__ import annotations

import argparse
import json

import torch

from kvseal import LLM, SamplingParams
from kvseal.config import CacheConfig, EngineConfig, ModelConfig
from kvseal.engine.engine import Engine
from kvseal.model.loader import load_checkpoint

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime, and explain it.",
    "List three facts about the moon.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me a recipe for pancakes.",
    "What are the main differences between TCP and UDP?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Translate 'good morning, how are you?' into French and Spanish.",
]


def greedy(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = LLM.from_engine(engine).generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    ck = load_checkpoint(None, progress=False)
    tok = ck.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS]
    runs = {}
    for dtype in ("float32", "bfloat16"):
        cfg = EngineConfig(model=ModelConfig(dtype=dtype, max_model_len=2048), cache=CacheConfig(pool_tokens=4096))
        runs[dtype] = greedy(Engine(cfg, ck), prompts, args.new_tokens)
        torch.manual_seed(0)
    firsts: list[int | None] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                for a, b in zip(runs["float32"], runs["bfloat16"])]
    print(f"| prompt | first bf16 != fp32 token (of {args.new_tokens}) |\n|---|---|")
    for p, first in zip(PROMPTS, firsts):
        print(f"| {p[:50]} | {'none' if first is None else first} |")
    prefix = [args.new_tokens if f is None else f for f in firsts]
    print(f"\n{firsts.count(None)}/{len(firsts)} prompts identical for all {args.new_tokens} tokens; "
          f"mean agreeing prefix {sum(prefix) / len(prefix):.1f} tokens")
    print(json.dumps({"new_tokens": args.new_tokens, "prompts": PROMPTS, "first_divergence": firsts}))


if __name__ == "__main__":
    main()

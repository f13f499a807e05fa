"""The real Qwen2.5-Coder Q4_K_M files with the exact arithmetic: kvseal's greedy ids equal transformers' fp32 ones
on the same dequantized weights (transformers reads the GGUF itself: gguf-py's dequantization, its own name mapping
and q/k layout), token for token. kvseal multiplies the file's blocks as stored, dequantized in registers.

The 0.5B (491 MB; Q5_0, Q8_0, Q6_K, Q4_K) runs in every `make test`; the 1.5B (1.12 GB; Q4_K, Q6_K), whose float32
copy in transformers takes 6 GB and a minute to build, is opt-in: `make test-slow` (pytest -m slow)."""

from __future__ import annotations

import os

import pytest
import torch

from kvseal import LLM, SamplingParams
from kvseal.model.gguf import load_gguf
from tests.helpers.bundled import fast_transformers_gguf
from tests.helpers.real_models import real_model

pytestmark = pytest.mark.e2e
NEW = 16
PROMPTS = ["def fibonacci(n):", "# Quick sort in Python\n"]


def transformers_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    import transformers

    with fast_transformers_gguf():  # the same load, its GGUF reader built once instead of three times
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            out.append(gen[0, len(ids):].tolist())
    return out


def check(name: str, kernels: list[str]) -> None:
    path = real_model(name)
    ck = load_gguf(path, progress=False)
    # several prefill chunks of 128: real code (random ids make near-ties between special tokens, where float
    # rounding in another summation order may pick either)
    chunked = "".join(f"def area_{i}(w, h):\n    return w * h + {i * 7 % 13}\n\n" for i in range(24))
    prompts = [ck.tokenizer.encode(p) for p in [*PROMPTS, chunked + "def total("]]
    assert len(prompts[-1]) > 300, len(prompts[-1])
    expected = transformers_greedy(path, prompts)
    for k in kernels:
        llm = LLM(checkpoint=ck, kernels=k, arithmetic="exact", page_size=16, pool_tokens=2048, max_model_len=1024,
                  max_num_batched_tokens=128)
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == expected, k


def test_qwen25_coder_05b_greedy_equals_transformers() -> None:
    check("qwen2.5-coder-0.5b", ["native"])


@pytest.mark.slow
def test_qwen25_coder_15b_greedy_equals_transformers() -> None:
    check("qwen2.5-coder-1.5b", ["native", "torch"])

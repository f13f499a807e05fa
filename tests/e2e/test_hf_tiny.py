"""The Hugging Face loader, checked the same way as the GGUF path: greedy ids of kvseal's engine equal
transformers' on tiny random Llama and Qwen2 checkpoints that the test builds and saves (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvseal import LLM, SamplingParams
from kvseal.model.loader import load_checkpoint
from tests.helpers.tiny_models import hf_greedy, make_tiny_llama

pytestmark = pytest.mark.e2e
NEW = 24



@pytest.mark.parametrize("kernels", ["torch", "native"])
@pytest.mark.parametrize(("family", "tie"), [("llama", True), ("llama", False), ("qwen2", False)])
def test_engine_equals_transformers_on_tiny_hf_models(tmp_path: Path, family: str, tie: bool, kernels: str) -> None:
    folder = make_tiny_llama(tmp_path, family, tie)
    ck = load_checkpoint(folder, progress=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, ck.arch.vocab_size, (n,), generator=g).tolist() for n in (5, 37, 90)]
    expected = hf_greedy(folder, prompts, NEW)
    assert len({t for seq in expected for t in seq}) > 1  # a real continuation, not one repeated token
    llm = LLM(checkpoint=ck, kernels=kernels, arithmetic="exact", page_size=8, pool_tokens=1024,
              max_num_batched_tokens=32)
    assert llm.engine.kernels == kernels
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected

"""The architectures of issue 18 (Llama 3, Qwen3, Mistral, Gemma 3) against transformers fp32: greedy ids of
kvseal's engine with the exact arithmetic equal transformers' on tiny random checkpoints the test builds, token for
token, with prompts (and chunked prefills) running past Mistral's and Gemma 3's sliding window, whose layers keep only
their window of KV pages (kvseal/kv/window.py): the pages that left it were dropped, and both pools are back at their
baseline after."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvseal import LLM, SamplingParams
from kvseal.model.checkpoint import Checkpoint
from kvseal.model.gguf import load_gguf
from kvseal.model.loader import load_checkpoint
from tests.helpers.tiny_gguf import write_tiny_gguf
from tests.helpers.tiny_models import TINY_WINDOW, hf_greedy, make_tiny_arch

pytestmark = pytest.mark.e2e
NEW = 20
PROMPT_LENS = (5, 37, 90)  # 37 and 90 pass the window of 16; 90 is prefilled in chunks of 32



def prompts_for(ck: Checkpoint, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, ck.arch.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def kvseal_greedy(ck: Checkpoint, prompts: list[list[int]], kernels: str, new: int = NEW) -> list[list[int]]:
    llm = LLM(checkpoint=ck, kernels=kernels, arithmetic="exact", page_size=8, pool_tokens=1024,
              max_num_batched_tokens=32)
    e = llm.engine
    assert e.kernels == kernels and not e.arithmetic.fast
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    windowed = TINY_WINDOW in ck.arch.layer_windows
    assert (e.window is not None) == windowed  # Mistral, Gemma 3: the sliding layers in a pool of their own
    if e.window is not None:
        assert e.window.layers == tuple(i for i, w in enumerate(ck.arch.layer_windows) if w)
        # every page before the last window of each sequence went, as it left (8-token pages, a 16-token window)
        last = [len(p) + new - 1 for p in prompts]
        assert e.window.pages_dropped == sum(max(0, n - TINY_WINDOW + 1) // 8 for n in last) > 0
        e.window.allocator.check_integrity()
        assert e.window.allocator.num_free == e.window.pool.num_pages and not e.window.pool.k.any()
    e.allocator.check_integrity()
    assert e.allocator.num_free == e.pool.num_pages
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("arch")


@pytest.mark.parametrize("kernels", ["torch", "native"])
@pytest.mark.parametrize("kind", ["llama3", "qwen3", "mistral", "gemma3"])
def test_hf_folder_equals_transformers(tiny_dir: Path, kind: str, kernels: str) -> None:
    folder = make_tiny_arch(tiny_dir, kind)
    ck = load_checkpoint(folder, progress=False)
    prompts = prompts_for(ck)
    expected = hf_greedy(folder, prompts, NEW)
    assert all(len(set(seq)) >= 5 for seq in expected)  # real continuations, not one repeated token
    if kind in ("mistral", "gemma3"):
        assert TINY_WINDOW in ck.arch.layer_windows and max(PROMPT_LENS) + NEW > 2 * TINY_WINDOW
    assert kvseal_greedy(ck, prompts, kernels) == expected


@pytest.mark.parametrize("kind", ["llama3", "qwen3", "mistral", "gemma3"])
def test_gguf_equals_transformers(tiny_dir: Path, kind: str) -> None:
    """The same models written as llama.cpp writes them (Llama 3: a rope_freqs tensor and no scaling keys; Mistral:
    the llama architecture, q/k permuted; Gemma 3: norms with 1 added, a sliding-window pattern), float32: kvseal
    reads back the architecture transformers has and gives its greedy ids (native kernels)."""
    overrides = {"query_pre_attn_scalar": 16} if kind == "gemma3" else {}  # a GGUF has none: llama.cpp's head_dim
    folder = make_tiny_arch(tiny_dir, kind, **overrides)
    arch_name = "llama" if kind in ("llama3", "mistral") else kind
    path = write_tiny_gguf(folder, str(tiny_dir / f"{kind}.gguf"), arch_name=arch_name,
                           pre="qwen2" if kind == "qwen3" else "smollm")
    hf = load_checkpoint(folder, progress=False)
    ck = load_gguf(path, progress=False)
    assert ck.arch == dataclasses.replace(hf.arch, rms_eps=ck.arch.rms_eps, family=ck.arch.family)
    if kind == "llama3":  # the divisors were recognised as HF's llama3 scaling
        assert dict(ck.arch.rope_scaling or ())["rope_type"] == "llama3"
    prompts = prompts_for(ck)
    expected = hf_greedy(folder, prompts, NEW)
    assert all(len(set(seq)) >= 5 for seq in expected)
    assert kvseal_greedy(ck, prompts, "native") == expected

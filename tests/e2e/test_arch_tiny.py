"""The architectures of issue 18 (Llama 3, Qwen3, Mistral, Gemma 3) against transformers fp32: greedy ids of
kvseal's engine with the exact arithmetic equal transformers' on tiny random checkpoints the test builds, token for
token, with prompts (and chunked prefills) running past Mistral's and Gemma 3's sliding window, whose layers keep only
their window of KV pages (kvseal/kv/window.py): the pages that left it were dropped, and both pools are back at their
baseline after."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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


def kvseal_greedy(ck: Checkpoint, prompts: list[list[int]], kernels: str, new: int = NEW, arithmetic: str = "exact",
                  kv_dtype: str = "auto") -> list[list[int]]:
    ps = 16 if arithmetic == "fast" else 8  # the fast kernels take pages of multiples of 16 tokens
    llm = LLM(checkpoint=ck, kernels=kernels, arithmetic=arithmetic, kv_dtype=kv_dtype, page_size=ps, pool_tokens=1024,
              max_num_batched_tokens=32)
    e = llm.engine
    assert e.kernels == kernels and e.arithmetic.fast == (arithmetic == "fast")
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    windowed = TINY_WINDOW in ck.arch.layer_windows
    assert (e.window is not None) == windowed  # Mistral, Gemma 3: the sliding layers in a pool of their own
    if e.window is not None:
        assert e.window.layers == tuple(i for i, w in enumerate(ck.arch.layer_windows) if w)
        # every page before the last window of each sequence went, as it left
        last = [len(p) + new - 1 for p in prompts]
        assert e.window.pages_dropped == sum(max(0, n - TINY_WINDOW + 1) // ps for n in last) > 0
        e.window.allocator.check_integrity()
        assert e.window.allocator.num_free == e.window.pool.num_pages and not e.window.pool.k.any()
    e.allocator.check_integrity()
    assert e.allocator.num_free == e.pool.num_pages
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("arch")


@pytest.fixture(scope="module")
def hf_expected(tiny_dir: Path) -> Callable[[str], tuple[Checkpoint, list[list[int]], list[list[int]]]]:
    """kind -> (its tiny checkpoint from the HF folder, prompts, transformers' greedy ids), each computed once."""
    done: dict[str, tuple[Checkpoint, list[list[int]], list[list[int]]]] = {}

    def get(kind: str) -> tuple[Checkpoint, list[list[int]], list[list[int]]]:
        if kind not in done:
            folder = make_tiny_arch(tiny_dir, kind)
            ck = load_checkpoint(folder, progress=False)
            prompts = prompts_for(ck)
            done[kind] = (ck, prompts, hf_greedy(folder, prompts, NEW))
        return done[kind]

    return get


@pytest.mark.parametrize("kernels", ["torch", "native"])
@pytest.mark.parametrize("kind", ["llama3", "qwen3", "mistral", "gemma3"])
def test_hf_folder_equals_transformers(hf_expected: Callable[[str], tuple[Checkpoint, list[list[int]],
                                       list[list[int]]]], kind: str, kernels: str) -> None:
    ck, prompts, expected = hf_expected(kind)
    assert all(len(set(seq)) >= 5 for seq in expected)  # real continuations, not one repeated token
    if kind in ("mistral", "gemma3"):
        assert TINY_WINDOW in ck.arch.layer_windows and max(PROMPT_LENS) + NEW > 2 * TINY_WINDOW
    assert kvseal_greedy(ck, prompts, kernels) == expected


@pytest.mark.parametrize("kind", ["qwen3", "mistral", "gemma3"])
def test_fast_arithmetic_runs_each_family_and_equals_transformers(
        hf_expected: Callable[[str], tuple[Checkpoint, list[list[int]], list[list[int]]]], kind: str) -> None:
    """fast on the families it refused before (q/k norms, sandwich norms, GeGLU, scaled embeddings, the query scale,
    softcap, sliding windows with their pages dropped): these float32 checkpoints' weights are multiplied as they are,
    so with float32 KV its greedy ids are transformers'. The int8 products on K-quant blocks are measured on the real
    Gemma 3 270M (benchmarks.agreement, docs/benchmarks.md)."""
    ck, prompts, expected = hf_expected(kind)
    assert kvseal_greedy(ck, prompts, "native", arithmetic="fast", kv_dtype="float32") == expected


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

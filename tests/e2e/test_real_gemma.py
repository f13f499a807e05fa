"""Gemma 3 270M Q4_K_M (gemma3; Q8_0, Q5_0, Q4_K, Q6_K), fetched by scripts/fetch_models.py: kvseal reads it as
transformers does (its SentencePiece tokenizer, its architecture) and, with the exact arithmetic, greedy ids equal
transformers' fp32 ones on the same dequantized weights, for a prompt longer than its 512-token sliding window.

The comparison loads transformers' copy of the model (about 1 GB of float32) and runs a 600-token prompt: it is
opt-in, like the other slow real-model comparisons (`make test-slow`: pytest -m slow)."""

from __future__ import annotations

import os

import pytest
import torch

from kvseal import LLM, SamplingParams
from kvseal.model.checkpoint import Checkpoint
from kvseal.model.gguf import load_gguf
from tests.helpers.real_models import real_model

pytestmark = pytest.mark.e2e
slow = pytest.mark.slow  # deselected by `make test`; `make test-slow` runs them
NEW = 24
TEXTS = ["The capital of France is", "  two  spaces\tand a tab\nnew line", "héllo wörld 🤖 日本語のテキスト",
         "<start_of_turn>user\nhi<end_of_turn>\n", "def f(x):\n    return x**2  # squared", "a\u00a0b  \n\n\n   x"]


def test_gemma3_270m_loads_as_gemma3() -> None:
    ck = load_gguf(real_model("gemma-3-270m"), progress=False)
    a = ck.arch
    assert (a.family, a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim) == (
        "gemma3", 18, 640, 4, 1, 256)
    # every 6th layer global, the rest slide over 512 tokens; local rope 1e4, global 1e6
    assert a.layer_windows == tuple(0 if i % 6 == 5 else 512 for i in range(18))
    assert (a.rope_theta, a.local_rope_theta, a.attn_scalar, a.embed_scale) == (1e6, 1e4, 256.0, 640**0.5)
    assert a.qk_norm and a.sandwich_norms and a.mlp_act == "gelu_tanh" and a.tie_embeddings
    assert set(ck.block_types().values()) == {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}
    tok = ck.tokenizer
    assert tok.add_bos and tok.bos_id == 2 and tok.eos_ids[0] == 1
    assert tok.encode("The capital of France is")[0] == 2
    for text in TEXTS:  # round trip, byte fallback included
        assert tok.decode(tok.encode(text)[1:], skip_special_tokens=False) == text


@slow
def test_gemma3_270m_tokenizer_equals_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    path = real_model("gemma-3-270m")
    hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok = load_gguf(path, progress=False).tokenizer
    for text in TEXTS:
        assert tok.encode(text) == hf(text)["input_ids"], text


@pytest.fixture(scope="module")
def gemma_expected() -> tuple[Checkpoint, list[list[int]], list[list[int]]]:
    """(checkpoint, prompts, transformers' greedy ids): the 600-token prompt runs past the 512-token window."""
    transformers = pytest.importorskip("transformers")
    path = real_model("gemma-3-270m")
    ck = load_gguf(path, progress=False)
    g = torch.Generator().manual_seed(0)
    long = [2, *torch.randint(10, 20000, (600,), generator=g).tolist()]
    prompts = [ck.tokenizer.encode("The capital of France is"), long]
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                              dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
            expected.append(out[0, len(ids):].tolist())
    return ck, prompts, expected


@slow
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_gemma3_270m_greedy_equals_transformers(
        gemma_expected: tuple[Checkpoint, list[list[int]], list[list[int]]], kernels: str) -> None:
    ck, prompts, expected = gemma_expected
    llm = LLM(checkpoint=ck, kernels=kernels, arithmetic="exact", page_size=16, pool_tokens=2048,
              max_model_len=1024, max_num_batched_tokens=256)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected

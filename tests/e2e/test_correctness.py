"""Seal 10 for the engine: greedy ids equal Hugging Face transformers' for the same GGUF weights (fp32),
alone and batched, including a >1,000-token prompt prefilled in chunks. One differing token fails.

Both kernel sets are held to it: torch (each quantized matrix dequantized at every call into a scratch buffer,
torch ops: transformers' arithmetic) and native (the file's Q4_1/Q8_0 blocks multiplied as stored, kvseal's paged
attention kernel), whose sums run in another order and so differ from transformers' logits by float rounding
only."""

from __future__ import annotations

import pytest
import torch

from kvseal import LLM, SamplingParams
from kvseal.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvseal.engine.engine import Engine
from kvseal.model.checkpoint import Checkpoint
from tests.helpers.bundled import transformers_gguf_model

pytestmark = pytest.mark.e2e
NEW_TOKENS = 48


def _prompts(ck: Checkpoint) -> list[list[int]]:
    tok = ck.tokenizer
    chats = [
        "What is the capital of France?",
        "Write a Python function that checks whether a number is prime, and explain it.",
        "List three facts about the moon.",
    ]
    out = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False)
           for c in chats]
    story = " ".join(f"Day {i}: the caravan crossed dune number {i * 7 % 31} and counted {i * 13 % 97} stars."
                     for i in range(1, 90))
    long_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": story + " Summarize the trip."}]),
                          add_special_tokens=False)
    assert len(long_ids) > 1000, len(long_ids)
    out.append(long_ids)
    # code to copy: with --speculative lookup (the default) its drafts are mostly accepted (engine/drafts.py)
    code = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
    out.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": "Repeat this code exactly:\n\n"
                                                   + code}]), add_special_tokens=False))
    return out


@pytest.fixture(scope="module")
def hf_reference(smol: Checkpoint) -> tuple[list[list[int]], list[list[int]]]:
    """transformers loads the GGUF itself; greedy continuation by its own KV cache, EOS not special-cased."""
    pytest.importorskip("transformers")
    model = transformers_gguf_model().eval()  # transformers' own load, its GGUF reader memoized (bundled.py)
    prompts, refs = _prompts(smol), []
    with torch.inference_mode():
        for ids in prompts:
            out = model(torch.tensor([ids]), use_cache=True)
            past, new = out.past_key_values, []
            for _ in range(NEW_TOKENS):
                nxt = int(out.logits[0, -1].argmax())
                new.append(nxt)
                out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
            refs.append(new)
    return prompts, refs


def _engine(ck: Checkpoint, kernels: str, budget: int = 256, arithmetic: str = "exact",
            speculative: str = "lookup") -> Engine:
    engine = Engine(EngineConfig(model=ModelConfig(kernels=kernels, arithmetic=arithmetic),
                                 cache=CacheConfig(page_size=16, pool_tokens=8192),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=budget, speculative=speculative)),
                    ck)
    assert engine.kernels == kernels
    return engine


def _run(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    outs = LLM.from_engine(engine).generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                                    ignore_eos=True))
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * len(prompts)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_greedy_alone_equals_transformers(smol: Checkpoint, hf_reference, kernels: str) -> None:
    prompts, refs = hf_reference
    engine = _engine(smol, kernels)
    for ids, ref in zip(prompts, refs):
        assert _run(engine, [ids]) == [ref]
    engine.allocator.check_integrity()
    assert engine.allocator.num_free == engine.pool.num_pages
    assert engine.drafter.accepted > 0  # speculation (on by default) ran, and its tokens are transformers'


def test_fast_with_drafts_is_bit_for_bit_fast_without(smol: Checkpoint) -> None:
    """fast is batch- and chunk-invariant: a draft verified in rows after its request's last token gives the logits
    of decoding one token at a time, so the greedy tokens with speculation equal those without, every one."""
    prompts = _prompts(smol)
    with_drafts = _engine(smol, "native", arithmetic="fast")
    without = _engine(smol, "native", arithmetic="fast", speculative="off")
    assert with_drafts.arithmetic.fast  # AVX2 at least: every machine kvseal supports
    for ids in prompts:
        assert _run(with_drafts, [ids]) == _run(without, [ids])
    assert with_drafts.drafter.accepted > 0 and without.drafter.drafted == 0


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_greedy_batched_equals_transformers(smol: Checkpoint, hf_reference, kernels: str) -> None:
    prompts, refs = hf_reference
    engine = _engine(smol, kernels, budget=512)
    assert _run(engine, prompts) == refs
    assert engine.allocator.num_free == engine.pool.num_pages

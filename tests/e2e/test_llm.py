"""kvseal.LLM: vLLM's offline API over the same engine that serves HTTP, with vLLM's output shapes."""

from __future__ import annotations

import json

import pytest

import kvseal
from kvseal import LLM, SamplingParams
from kvseal.errors import ContextLengthExceeded

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=1024)  # model=None: the bundled SmolLM2-135M-Instruct


def test_generate_is_shaped_like_vllm(llm: LLM) -> None:
    outs = llm.generate(["The capital of France is", "1, 2, 3,"], SamplingParams(temperature=0, max_tokens=6,
                                                                                  ignore_eos=True))
    assert [o.prompt for o in outs] == ["The capital of France is", "1, 2, 3,"]
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("The capital of France is")
    first = outs[0].outputs[0]
    assert first.index == 0 and first.finish_reason == "length" and len(first.token_ids) == 6
    assert first.text == llm.tokenizer.decode(first.token_ids) and "Paris" in first.text
    assert outs[1].outputs[0].text.startswith(" 4")
    # token ids in, the same greedy tokens out; a single prompt needs no list
    again = llm.generate(outs[0].prompt_token_ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert again[0].outputs[0].token_ids == first.token_ids and again[0].prompt is None
    assert llm.engine.allocator.num_free == llm.engine.pool.num_pages  # every page back (seal 8)


def test_chat_renders_the_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
                   SamplingParams(temperature=0, max_tokens=30))
    assert out[0].prompt is not None and out[0].prompt.startswith("<|im_start|>")
    assert "Paris" in out[0].outputs[0].text and out[0].outputs[0].finish_reason == "stop"
    custom = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1),
                      chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    assert custom[0].prompt == "hi"


def test_n_samples_logprobs_and_seeds(llm: LLM) -> None:
    prompt = "Once upon a time, in a land far away, there lived a " * 3
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, logprobs=2)
    before = llm.engine.scheduler.reused_tokens
    out = llm.generate(prompt, params)[0]
    n_prompt = len(out.prompt_token_ids)
    assert llm.engine.scheduler.reused_tokens - before == 2 * ((n_prompt - 1) // 16 * 16)  # shared pages
    assert [c.index for c in out.outputs] == [0, 1, 2] and len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert [c.token_ids for c in llm.generate(prompt, params)[0].outputs] == [c.token_ids for c in out.outputs]
    for c in out.outputs:
        assert c.logprobs is not None and len(c.logprobs) == 5 and c.cumulative_logprob is not None
        assert all(tid in lp for tid, lp in zip(c.token_ids, c.logprobs))
        assert c.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs)))


def test_response_format(llm: LLM) -> None:
    schema = {"type": "object",
              "properties": {"city": {"type": "string"},
                             "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
              "required": ["city", "population"]}
    out = llm.chat([{"role": "user", "content": "Tell me about Paris."}],
                   SamplingParams(temperature=0, max_tokens=60,
                                  response_format={"type": "json_schema", "json_schema": {"schema": schema}}))
    doc = json.loads(out[0].outputs[0].text)
    assert isinstance(doc["city"], str) and 0 <= doc["population"] <= 10**8
    assert out[0].outputs[0].finish_reason == "stop"


def test_refusals_raise_their_error(llm: LLM) -> None:
    with pytest.raises(ContextLengthExceeded):
        llm.generate("word " * 2000, SamplingParams(max_tokens=4))
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(no_such_option=1)
    with pytest.raises(ValueError, match="n=0"):
        SamplingParams(n=0)
    assert llm.engine.allocator.num_free == llm.engine.pool.num_pages
    assert kvseal.LLM is LLM

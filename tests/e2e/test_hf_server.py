"""benchmarks.hf_server as a real process on loopback, driven by the official openai client: its greedy
tokens equal transformers' own `generate` on the model transformers loads from the bundled GGUF."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import openai
import pytest
import torch

from benchmarks.common import ManagedServer, free_port
from benchmarks.systems import Settings, launch
from kvseal.model.locate import default_model_path
from tests.helpers.bundled import transformers_gguf_model, transformers_gguf_tokenizer

pytestmark = pytest.mark.e2e
PROMPT = "The capital of France is"
N = 8
Reference = tuple[list[int], list[int], str]


@pytest.fixture(scope="module")
def hf_server() -> Iterator[ManagedServer]:
    """Started, not yet waited for: the reference model loads in this process meanwhile."""
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix="hf-server-", suffix=".log", delete=False) as log:
        pass
    how = launch("hf", port, Settings(model_path=default_model_path(), n_ctx=2048))
    srv = ManagedServer(list(how.argv), f"http://127.0.0.1:{port}", how.ready_path, log.name)
    try:
        yield srv
    finally:
        srv.stop()
        os.unlink(log.name)


@pytest.fixture(scope="module")
def reference(hf_server: ManagedServer) -> Reference:
    """(prompt ids, greedy ids, their text) from transformers alone: its GGUF tokenizer and model."""
    tok = transformers_gguf_tokenizer()
    model = transformers_gguf_model().eval()
    ids = tok(PROMPT, add_special_tokens=False).input_ids
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=N, min_new_tokens=N,
                             pad_token_id=tok.eos_token_id)
    gen = [int(t) for t in out[0, len(ids):]]
    return ids, gen, tok.decode(gen, skip_special_tokens=True)


@pytest.fixture(scope="module")
def client(hf_server: ManagedServer, reference: Reference) -> openai.OpenAI:
    hf_server.wait_ready(300)
    return openai.OpenAI(base_url=hf_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_bundled_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]


def test_greedy_text_prompt_equals_transformers(client: openai.OpenAI, reference: Reference) -> None:
    ids, gen, text = reference
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=N, temperature=0,
                                  extra_body={"min_tokens": N})
    choice = r.choices[0]
    assert choice.model_extra is not None and choice.model_extra["token_ids"] == gen
    assert choice.text == text and choice.finish_reason == "length"
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), N)


def test_greedy_stream_of_token_ids_equals_transformers(client: openai.OpenAI, reference: Reference) -> None:
    ids, gen, text = reference
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=N, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"min_tokens": N})
    chunks = list(stream)
    with_choice = [c for c in chunks if c.choices]
    assert len(with_choice) >= 2  # tokens arrive step by step, not all at the end
    got = [t for c in with_choice for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert got == gen
    assert "".join(c.choices[0].text for c in with_choice) == text
    assert with_choice[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and not chunks[-1].choices
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ids), N)


def test_bad_request_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.completions.create(model="x", prompt="hi", max_tokens=2, stop=["\n"])

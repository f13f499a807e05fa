"""The unified server as a real process, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.helpers.procs import Server, wait_until

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module", params=["unified", "disaggregated"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    mode = ["--unified"] if request.param == "unified" else []
    s = Server([*mode, "--max-model-len", "2048", "--kv-pool-tokens", "8192"])
    try:
        yield s.ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=120)


def test_chat_names_paris(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40,
                                       messages=[{"role": "user",
                                                 "content": "What is the capital of France? Answer in one sentence."}])
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_and_length(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The first three planets are", max_tokens=8,
                                  temperature=0, logprobs=2)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert len(r.choices[0].logprobs.tokens) == 8
    assert all(len(t) == 2 for t in r.choices[0].logprobs.top_logprobs)


def test_streaming_equals_whole_and_reports_usage(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Name two colors."}]
    whole = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=30, messages=msgs)
    chunks = list(client.chat.completions.create(model=MODEL, temperature=0, max_tokens=30, messages=msgs,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_streaming_completion(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10,
                                            temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks)


def test_errors_are_openai_shaped(server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="word " * 3000, max_tokens=10)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=9)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=17)
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * (9 * 2**20)}, timeout=30)
    assert r.status_code == 413 and "error" in r.json()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=10,
                                  extra_body={"stream": True, "max_tokens": 5000})
    assert e.value.code == "context_length_exceeded"  # a stream that cannot run is never a 200
    ok = client.completions.create(model=MODEL, prompt="Still up?", max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_models_and_info(server: Server) -> None:
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 2048
    info = httpx.get(server.url + "/info").json()
    for key in ("model_fingerprint", "context_window", "pool_tokens", "page_size", "kv_dtype", "role"):
        assert key in info
    assert info["context_window"] == 2048 and info["pool_tokens"] == 8192
    workers = info["workers"] if info["role"] == "router" else [info]
    assert {w["role"] for w in workers} in ({"unified"}, {"prefill", "decode"})
    for w in workers:  # seal 8: nothing held between requests
        assert w["free_pages"] == w["pool_pages"], w


def _all_pages_free(server: Server) -> bool:
    info = httpx.get(server.url + "/info").json()
    workers = info["workers"] if info["role"] == "router" else [info]
    return all(w["free_pages"] == w["pool_pages"] and w["running"] == 0 for w in workers)


def test_client_disconnect_frees_pages_at_once(server: Server) -> None:
    body = {"model": MODEL, "prompt": "Write a very long essay about rivers.", "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as http, http.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(x.startswith("data: ") for x in got)
        held = httpx.get(server.url + "/info").json()
    # the stream is closed here, long before 1,500 tokens: every page must come back within seconds
    wait_until(lambda: _all_pages_free(server), 20, "pages freed after the client disconnected")
    if held["role"] == "router":
        wait_until(lambda: httpx.get(server.url + "/info").json()["ended"]["aborted"] >= 1, 10, "aborted")


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"logit_bias": {"50": 10}}, "logit_bias"),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "x"}]}, "messages.0.tool_call_id"),
])
def test_unimplemented_fields_are_a_400_naming_them(client: openai.OpenAI, extra: dict[str, object],
                                                    param: str) -> None:
    """Never a free-text 200 in place of what a field asked for (seal 2): the field is named."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body=extra)
    assert e.value.status_code == 400 and e.value.param == param and param in e.value.message
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                        extra_body={"tools": None, "logit_bias": None})  # null is absent
    assert ok.usage.completion_tokens == 2


def test_tokenize_and_detokenize_in_vllms_shape(server: Server, client: openai.OpenAI) -> None:
    prompt = "The first three planets are"
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True},
                   timeout=30).json()
    used = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0).usage
    assert r["count"] == len(r["tokens"]) == used.prompt_tokens and r["max_model_len"] == 2048
    assert "".join(r["token_strs"]) == prompt
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
    assert back == {"prompt": prompt}
    msgs = [{"role": "user", "content": "Name two colors."}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": msgs}, timeout=30).json()
    chat_used = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0).usage
    assert chat["count"] == chat_used.prompt_tokens and chat["token_strs"] is None
    assert "<|im_start|>user\nName two colors." in httpx.post(
        server.url + "/detokenize", json={"tokens": chat["tokens"]}, timeout=30).json()["prompt"]
    for path, body, param in (("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
                              ("/tokenize", {"prompt": "x", "model": "nope"}, "model"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")):
        bad = httpx.post(server.url + path, json=body, timeout=30)
        assert bad.status_code in (400, 404) and bad.json()["error"]["param"] == param, bad.text


def test_version(server: Server) -> None:
    import kvseal

    assert httpx.get(server.url + "/version", timeout=30).json() == {"version": kvseal.__version__}


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "colors": {"type": "array", "items": {"type": "string"},
                                                      "minItems": 1, "maxItems": 3}},
          "required": ["name", "age", "colors"], "additionalProperties": False}


def test_response_format_json_schema_is_valid_json_for_the_schema(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=120, response_format=fmt,
                                       messages=[{"role": "user", "content": "Describe a person."}])
    assert r.choices[0].finish_reason == "stop"
    person = json.loads(r.choices[0].message.content)
    assert list(person) == ["name", "age", "colors"]  # the schema's order, nothing else
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    assert 1 <= len(person["colors"]) <= 3 and all(isinstance(c, str) for c in person["colors"])
    free = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=30,
                                          messages=[{"role": "user", "content": "Describe a person."}])
    with pytest.raises(json.JSONDecodeError):  # the same prompt without the format: prose, not JSON
        json.loads(free.choices[0].message.content)
    streamed = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=120, response_format=fmt,
                                              messages=[{"role": "user", "content": "Describe a person."}],
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == r.choices[0].message.content


def _strict_json(text: str) -> object:
    def refuse(name: str) -> object:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)  # Python's json would take -Infinity and NaN


def test_response_format_with_logprobs_reports_the_models_own_finite_logprobs(server: Server) -> None:
    """Logprobs of the unmasked distribution (as vLLM): finite, and where the grammar forced a token the model
    did not prefer, its preferred one shows above it. Streamed: every event strict JSON."""
    body = {"model": MODEL, "temperature": 0, "max_tokens": 80, "logprobs": True, "top_logprobs": 3,
            "messages": [{"role": "user", "content": "Describe a person."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = _strict_json(r.text)["choices"][0]  # type: ignore[index]
    person = json.loads(choice["message"]["content"])
    assert list(person) == ["name", "age", "colors"]
    content = choice["logprobs"]["content"]
    values = [e["logprob"] for e in content] + [t["logprob"] for e in content for t in e["top_logprobs"]]
    assert all(math.isfinite(v) and v <= 0 for v in values) and all(len(e["top_logprobs"]) == 3 for e in content)
    assert any(e["top_logprobs"][0]["logprob"] > e["logprob"] for e in content)  # a token the grammar forced
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        assert s.status_code == 200
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [_strict_json(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])  # type: ignore[index]
    streamed = [e["logprob"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]  # type: ignore[index]
                for e in c["choices"][0]["logprobs"]["content"]]  # type: ignore[index]
    assert text == choice["message"]["content"] and streamed == [e["logprob"] for e in content]


def test_response_format_json_object(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="A JSON object about Paris:", temperature=0, max_tokens=80,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)


@pytest.mark.parametrize(("fmt", "param"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5,
                                                                      "maximum": 1}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema"}, "response_format"),
    ({"type": "grammar", "grammar": "root ::= x"}, "response_format.type"),
])
def test_response_format_that_cannot_be_enforced_is_a_400(client: openai.OpenAI, fmt: dict[str, object],
                                                          param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       response_format=fmt)  # type: ignore[arg-type]
    assert e.value.param == param, e.value.message


def _cache_hits(server: Server) -> int:
    info = httpx.get(server.url + "/info", timeout=30).json()
    return sum(w["prefix_cache_hit_tokens"] for w in (info["workers"] if info["role"] == "router" else [info])
               if w["role"] != "decode")


def test_n_samples_share_the_prompt_pages_and_keep_their_own_seeds(server: Server, client: openai.OpenAI) -> None:
    prompt = f"Request {uuid.uuid4().hex}: " + "tell me a story about a cat and a dog. " * 5
    before = _cache_hits(server)
    r = client.completions.create(model=MODEL, prompt=prompt, n=3, temperature=1.0, seed=11, max_tokens=8,
                                  extra_body={"ignore_eos": True})
    prompt_tokens = r.usage.prompt_tokens
    # samples 1 and 2 started once sample 0 had computed (and cached) the prompt: every full page but the
    # one holding the last prompt token came from the cache, for each of them
    assert _cache_hits(server) - before == 2 * ((prompt_tokens - 1) // 16 * 16)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 24
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3  # three seed streams
    again = client.completions.create(model=MODEL, prompt=prompt, n=3, temperature=1.0, seed=11, max_tokens=8,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == texts  # the same seed, the same samples
    one = client.completions.create(model=MODEL, prompt=prompt, temperature=1.0, seed=11, max_tokens=8,
                                    extra_body={"ignore_eos": True})
    assert one.choices[0].text == texts[0]  # sample 0 keeps the request's seed
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, n=3, temperature=1.0, seed=11,
                                            max_tokens=8, stream=True, extra_body={"ignore_eos": True}))
    by_index = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert by_index == texts
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1, 2]
    wait_until(lambda: _all_pages_free(server), 20, "pages free after n samples")

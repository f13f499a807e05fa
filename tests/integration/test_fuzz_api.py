"""Property-based fuzzing of the public HTTP API of a real `kvseal serve --unified` process.

Hypothesis throws malformed JSON, invalid UTF-8, wrong types, negative and huge numbers, NaN/Infinity, lone
surrogates, empty and giant messages, unknown fields, odd content types and bodies over the size limit at
every endpoint the server documents in its own /openapi.json. Whatever arrives:
  * never a 5xx;
  * every non-200 is a 4xx with OpenAI-shaped JSON {"error": {"message": str, "type": str, ...}};
  * a 200 is a well-formed completion (whole or streamed, ending with a finish_reason and usage);
and afterwards the server still answers a normal greedy request correctly with every KV page free.

Generated valid requests keep max_tokens tiny (the model is real). KVSEAL_FUZZ_EXAMPLES scales the example
counts (default 1.0); the whole file runs in well under three minutes on two cores.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.helpers.procs import Server, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.e2e]
MODEL = "SmolLM2-135M-Instruct"
MAX_BODY = 65536
WINDOW = 512
VOCAB = 49152
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SCALE = float(os.environ.get("KVSEAL_FUZZ_EXAMPLES", "1.0"))


def fuzz_settings(n: int, shrink: bool = True) -> settings:
    """n examples (scaled); shrink=False where every example runs the model: a failure is reported as found
    instead of being minimised at the cost of minutes of generation."""
    phases = list(Phase) if shrink else [p for p in Phase if p not in (Phase.shrink, Phase.explain)]
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, phases=phases,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.large_base_example])


# -- the server ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(["--unified", "--max-model-len", str(WINDOW), "--kv-pool-tokens", "2048",
                "--max-body-bytes", str(MAX_BODY)])
    try:
        yield s.ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(120.0, connect=10.0)) as c:
        yield c


def at_baseline(http: httpx.Client) -> bool:
    info = http.get("/info").json()
    return info["free_pages"] == info["pool_pages"] and info["running"] == 0 and info["waiting"] == 0


# -- what every answer must look like ----------------------------------------------------------------------
def check_error(r: httpx.Response, sent: object) -> dict[str, Any]:
    assert 400 <= r.status_code < 500, f"{r.status_code} for {sent!r:.600}: {r.text[:600]}"
    assert r.headers.get("content-type", "").startswith("application/json"), (r.headers, r.text[:300])
    body = r.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    err = body["error"]
    assert isinstance(err.get("message"), str) and err["message"], body
    assert isinstance(err.get("type"), str) and err["type"], body
    return err


def check_usage(u: Any, max_tokens: int | None) -> None:
    assert isinstance(u, dict), u
    p, c, t = u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]
    assert all(isinstance(x, int) for x in (p, c, t)), u
    assert p >= 1 and c >= 1 and t == p + c and p + c <= WINDOW, u
    if max_tokens is not None:
        assert c <= max_tokens, (u, max_tokens)


def check_whole(obj: Any, chat: bool, max_tokens: int | None, token_ids: bool) -> None:
    assert isinstance(obj, dict), obj
    assert obj["object"] == ("chat.completion" if chat else "text_completion"), obj
    assert isinstance(obj["id"], str) and obj["id"] and obj["model"] == MODEL, obj
    assert isinstance(obj["created"], int), obj
    assert isinstance(obj["choices"], list) and len(obj["choices"]) == 1, obj
    ch = obj["choices"][0]
    assert ch["index"] == 0 and ch["finish_reason"] in ("stop", "length"), obj
    if chat:
        assert ch["message"]["role"] == "assistant" and isinstance(ch["message"]["content"], str), obj
    else:
        assert isinstance(ch["text"], str), obj
    check_usage(obj["usage"], max_tokens)
    if token_ids:
        assert isinstance(ch["token_ids"], list) and len(ch["token_ids"]) == obj["usage"]["completion_tokens"]
        assert all(isinstance(t, int) and 0 <= t < VOCAB for t in ch["token_ids"]), ch["token_ids"]


def check_stream(raw: str, chat: bool, max_tokens: int | None, include_usage: bool) -> None:
    events = [line.removeprefix("data: ") for line in raw.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"a 200 stream must end with [DONE]: {raw[-600:]!r}"
    objs = [json.loads(e) for e in events[:-1]]
    assert objs, raw
    finishes = []
    for o in objs:
        assert "error" not in o, f"a 200 stream carried an error event: {o}"
        assert o["object"] == ("chat.completion.chunk" if chat else "text_completion"), o
        assert o["model"] == MODEL and isinstance(o["id"], str), o
        for ch in o["choices"]:
            if chat:
                assert isinstance(ch["delta"], dict), o
            else:
                assert isinstance(ch["text"], str), o
            if ch["finish_reason"] is not None:
                finishes.append(ch["finish_reason"])
    assert len(finishes) == 1 and finishes[0] in ("stop", "length"), objs
    assert len({o["id"] for o in objs}) == 1, "every chunk of one stream carries the same id"
    if include_usage:
        assert objs[-1]["choices"] == [], objs[-1]
        check_usage(objs[-1]["usage"], max_tokens)


def send(http: httpx.Client, method: str, path: str, content: bytes | None = None,
         headers: dict[str, str] | None = None) -> httpx.Response:
    """One request, read to its end (a stream too)."""
    with http.stream(method, path, content=content, headers=headers) as r:
        r.read()
    return r


def check_any(r: httpx.Response, path: str, sent: object, max_tokens: int | None = None) -> None:
    """The property every answer to a POST on a completion endpoint must have, whatever was sent."""
    assert r.status_code < 500, f"{r.status_code} for {sent!r:.800}: {r.text[:800]}"
    if r.status_code != 200:
        check_error(r, sent)
        return
    chat = path == CHAT
    body = sent if isinstance(sent, dict) else {}
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        so = body.get("stream_options")
        check_stream(r.text, chat, max_tokens, isinstance(so, dict) and so.get("include_usage") is True)
    else:
        check_whole(r.json(), chat, max_tokens, body.get("return_token_ids") is True)


def post_json(http: httpx.Client, path: str, body: object) -> httpx.Response:
    # json.dumps writes NaN/Infinity literals and escapes lone surrogates as \udXXX, as hostile clients do
    return send(http, "POST", path, json.dumps(body).encode(), {"content-type": "application/json"})


# -- strategies ----------------------------------------------------------------------------------------------
# text of every kind: any code point, control characters and NUL; half the time with lone UTF-16 surrogates
# (valid JSON escapes such as "\\ud800" that are not text), which st.characters() alone almost never draws
any_char = st.characters(codec=None, exclude_categories=())
surrogate = st.integers(0xD800, 0xDFFF).map(chr)
wild_text = st.text(any_char, max_size=40) | st.text(any_char | any_char | surrogate, min_size=1, max_size=40)
plain_text = st.text(st.characters(codec="utf-8"), max_size=300)
huge_ints = st.sampled_from([-(2**63) - 1, -(2**63), -(2**31), -1, 0, 2**31, 2**53 + 1, 2**63 - 1, 2**63,
                             2**64, 10**30, 10**400])
nasty_floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [-0.0, 5e-324, 1e308, -1e308, 2.0000001, 1e-30])
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | huge_ints | nasty_floats | wild_text
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(wild_text, kids, max_size=4), max_leaves=12)
# Values for the token budgets: never None/absent and never a long valid budget (generation is real and slow).
budget_values = st.sampled_from([0, -1, -(2**63), 2**31, 2**64, 10**100, 1e308, float("nan"), float("inf"),
                                 -0.0, 0.5, 1.5, "", "x", "2", "1e3", [], {}, [2], True, False, WINDOW,
                                 WINDOW + 1, 10**6])
FIELDS = ["model", "messages", "prompt", "temperature", "top_p", "top_k", "n", "stream", "stream_options",
          "stop", "stop_token_ids", "seed", "presence_penalty", "frequency_penalty", "ignore_eos",
          "min_tokens", "user", "cache_salt", "return_token_ids", "logprobs", "top_logprobs", "echo",
          "suffix", "best_of", "add_generation_prompt"]
BUDGETS = ["max_tokens", "max_completion_tokens"]
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]) | wild_text,
     "content": st.none() | wild_text | st.lists(st.fixed_dictionaries({"type": st.just("text") | wild_text,
                                                                         "text": wild_text | scalars}),
                                                 max_size=3) | scalars},
    optional={"name": wild_text | scalars, "tool_calls": json_values})


def base_body(path: str) -> dict[str, Any]:
    if path == CHAT:
        return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2,
                "temperature": 0}
    return {"model": MODEL, "prompt": "Hello there", "max_tokens": 2, "temperature": 0}


@st.composite
def mutated_request(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid request with a few fields replaced by hostile values, dropped, or joined by unknown fields."""
    path = draw(st.sampled_from([CHAT, COMPLETIONS]))
    body = base_body(path)
    for key in draw(st.lists(st.sampled_from(FIELDS + BUDGETS), min_size=1, max_size=4, unique=True)):
        if key in BUDGETS:
            body[key] = draw(budget_values)
        elif key == "messages":
            body[key] = draw(st.lists(message, max_size=3) | json_values)
        elif key == "model" and draw(st.booleans()):
            del body[key]
        else:
            body[key] = draw(wild_text | json_values)
    for key in draw(st.lists(wild_text, max_size=3)):
        if key not in body and key not in BUDGETS:
            body[key] = draw(json_values)  # unknown fields (or known ones we did not pick) with any value
    return path, body


@st.composite
def valid_request(draw: st.DrawFn) -> tuple[str, dict[str, Any], int]:
    """A structurally valid request with a tiny budget: the server completes it (or refuses it as too
    long)."""
    path = draw(st.sampled_from([CHAT, COMPLETIONS]))
    max_tokens = draw(st.integers(1, 3))
    body: dict[str, Any] = {"model": MODEL}
    if path == CHAT:
        roles = st.sampled_from(["system", "user", "assistant", "developer"])
        content = plain_text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": plain_text}),
                                        min_size=1, max_size=3)
        msgs = draw(st.lists(st.fixed_dictionaries({"role": roles, "content": content}), max_size=3))
        msgs.append({"role": "user", "content": draw(content)})
        body["messages"] = msgs
        body[draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))] = max_tokens
        if draw(st.booleans()):
            body["logprobs"] = True
            body["top_logprobs"] = draw(st.integers(0, 20))
    else:
        body["prompt"] = draw(plain_text | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=300)
                              | st.lists(plain_text, min_size=1, max_size=1))
        body["max_tokens"] = max_tokens
        if draw(st.booleans()):
            body["logprobs"] = draw(st.integers(0, 20))
    optional = {
        "temperature": st.none() | st.floats(0.0, 2.0),
        "top_p": st.none() | st.floats(0.0, 1.0, exclude_min=True),
        "top_k": st.none() | st.integers(-1, 10**6),
        "seed": st.none() | st.integers(-(2**63), 2**63 - 1),
        "stop": st.none() | st.text(st.characters(codec="utf-8"), min_size=1, max_size=5)
        | st.lists(st.text(st.characters(codec="utf-8"), min_size=1, max_size=5), max_size=16),
        "stop_token_ids": st.none() | st.lists(st.integers(0, VOCAB - 1), max_size=4),
        "stream": st.booleans(),
        "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}),
        "ignore_eos": st.booleans(),
        "min_tokens": st.integers(0, 5),
        "n": st.just(1),
        "user": plain_text,
        "cache_salt": plain_text,
        "return_token_ids": st.booleans(),
        "presence_penalty": st.just(0.0),
        "tools": st.none(),  # null is absent; any other value of a field kvseal does not implement is a 400
    }
    for key in draw(st.lists(st.sampled_from(sorted(optional)), max_size=8, unique=True)):
        body[key] = draw(optional[key])
    return path, body, max_tokens


# -- the properties ------------------------------------------------------------------------------------------
VALID_BYTES = [json.dumps(base_body(CHAT)).encode(), json.dumps(base_body(COMPLETIONS)).encode()]
JUNK = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x00", b"\xc0\xaf", b"{", b"}", b"]", b",",
        b"\"", b"\\", b"NaN", b"\\ud800"]
ODD_BODIES = [b"", b"{", b"{}", b"[]", b"null", b"0", b"\"x\"", b"{\"model\": }", b"\xef\xbb\xbf{}",
              b"{\"model\": \"" + MODEL.encode() + b"\", \"prompt\": \"\xff\xfe\"}"]
raw_bodies = (st.binary(max_size=3000)
              | st.builds(lambda b, i, junk: b[:i] + junk + b[i:], st.sampled_from(VALID_BYTES),
                          st.integers(0, 120), st.sampled_from(JUNK))
              | st.sampled_from(ODD_BODIES))
content_types = st.sampled_from(["application/json", "application/json; charset=latin-1", "text/plain",
                                 "application/x-www-form-urlencoded", "multipart/form-data", ""])


@fuzz_settings(60)
@given(path=st.sampled_from([CHAT, COMPLETIONS]), raw=raw_bodies, content_type=content_types)
def test_raw_bytes_never_5xx(http: httpx.Client, path: str, raw: bytes, content_type: str) -> None:
    r = send(http, "POST", path, raw, {"content-type": content_type} if content_type else {})
    check_any(r, path, raw)


@fuzz_settings(40)
@given(path=st.sampled_from([CHAT, COMPLETIONS]), body=json_values)
def test_any_json_value_is_refused_cleanly(http: httpx.Client, path: str, body: object) -> None:
    r = post_json(http, path, body)
    assert r.status_code != 200 or (isinstance(body, dict) and body.get("model") == MODEL), r.text
    check_any(r, path, body)


@fuzz_settings(150)
@given(req=mutated_request())
def test_hostile_fields_never_5xx(http: httpx.Client, req: tuple[str, dict[str, Any]]) -> None:
    path, body = req
    r = post_json(http, path, body)
    budget = body.get("max_completion_tokens") or body.get("max_tokens")
    limit = budget if isinstance(budget, int) and not isinstance(budget, bool) and 1 <= budget else None
    check_any(r, path, body, limit if limit is not None and limit < WINDOW else None)
    if r.status_code != 200 and body.get("model", MODEL) != MODEL and isinstance(body.get("model"), str):
        assert r.status_code in (400, 404), r.text


@fuzz_settings(50, shrink=False)
@given(req=valid_request())
def test_valid_requests_complete(http: httpx.Client, req: tuple[str, dict[str, Any], int]) -> None:
    path, body, max_tokens = req
    r = post_json(http, path, body)
    check_any(r, path, body, max_tokens)
    if r.status_code != 200:  # a valid request may only be refused as too long or as an empty prompt
        err = check_error(r, body)
        assert r.status_code == 400 and (err.get("code") == "context_length_exceeded"
                                         or "empty" in err["message"]), r.text


@fuzz_settings(12)
@given(size=st.integers(MAX_BODY + 1, 4 * MAX_BODY), chunked=st.booleans(),
       path=st.sampled_from([CHAT, COMPLETIONS]), shape=st.sampled_from(["json", "garbage"]))
def test_bodies_over_the_limit_get_413(http: httpx.Client, size: int, chunked: bool, path: str,
                                       shape: str) -> None:
    if shape == "json":
        body = base_body(path)
        filler = "word " * (size // 5 + 1)
        body["prompt" if path == COMPLETIONS else "messages"] = (
            filler if path == COMPLETIONS else [{"role": "user", "content": filler}])
        data = json.dumps(body).encode()
    else:
        data = b"\xff{" * (size // 2 + 1)
    assert len(data) > MAX_BODY
    content: Any = iter([data[i:i + 8192] for i in range(0, len(data), 8192)]) if chunked else data
    with http.stream("POST", path, content=content, headers={"content-type": "application/json"}) as r:
        r.read()
    err = check_error(r, f"{len(data)} bytes, chunked={chunked}")
    assert r.status_code == 413 and err.get("code") == "payload_too_large", r.text


@fuzz_settings(8)
@given(path=st.sampled_from([CHAT, COMPLETIONS]), chars=st.integers(20_000, MAX_BODY - 400))
def test_giant_message_under_the_limit_is_context_length_exceeded(http: httpx.Client, path: str,
                                                                   chars: int) -> None:
    body = base_body(path)
    text = ("abc " * chars)[:chars]
    if path == CHAT:
        body["messages"] = [{"role": "system", "content": "x"}, {"role": "user", "content": text}]
    else:
        body["prompt"] = text
    data = json.dumps(body).encode()
    assert len(data) <= MAX_BODY
    r = send(http, "POST", path, data, {"content-type": "application/json"})
    err = check_error(r, f"{chars} chars")
    assert r.status_code == 400 and err.get("code") == "context_length_exceeded", r.text


# -- regressions the fuzzing found (each one was a 5xx) ----------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-40, 5e-324])
def test_tiny_temperature_is_no_server_error_and_hurts_no_neighbour(server: Server, http: httpx.Client,
                                                                     temperature: float) -> None:
    """A temperature so small that logits / temperature overflows float32 must not fail the request, and must
    not fail the other requests that share its batch."""
    victim = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 60, "temperature": 0,
              "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=120) as other, \
            other.stream("POST", COMPLETIONS, json=victim) as vr:
        assert vr.status_code == 200
        lines = vr.iter_lines()
        assert next(lines).startswith("data: ")  # the victim is decoding now
        body = {"model": MODEL, "prompt": "0", "max_tokens": 2, "temperature": temperature}
        r = post_json(http, COMPLETIONS, body)
        check_any(r, COMPLETIONS, body, 2)
        rest = "\n".join(lines)
    check_stream(rest, False, 60, False)  # the neighbour finished normally, no error event
    wait_until(lambda: at_baseline(http), 30, "pages free")


@pytest.mark.parametrize(("path", "field"), [(COMPLETIONS, "prompt"), (COMPLETIONS, "prompt_list"),
                                             (CHAT, "messages"), (COMPLETIONS, "model"), (CHAT, "model")])
def test_lone_surrogates_are_a_400(http: httpx.Client, path: str, field: str) -> None:
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"); it is not text. The answer is a 4xx, not a 500."""
    body = base_body(path)
    bad = "a\ud800b"
    if field == "prompt":
        body["prompt"] = bad
    elif field == "prompt_list":
        body["prompt"] = [bad]
    elif field == "messages":
        body["messages"] = [{"role": "user", "content": bad}]
    else:
        body["model"] = bad
    r = post_json(http, path, body)
    check_error(r, body)
    assert r.status_code == (404 if field == "model" else 400), r.text


@pytest.fixture(scope="module")
def disagg_server() -> Iterator[Server]:
    s = Server(["--max-model-len", str(WINDOW), "--kv-pool-tokens", "2048",
                "--max-body-bytes", str(MAX_BODY)])
    try:
        yield s.ready(300)
    finally:
        s.stop()


HOSTILE_ACROSS_PROCESSES = [  # values the unified engine takes in stride, but that cross a process boundary
    ("top_k", 10**30), ("stop_token_ids", [2**70]), ("min_tokens", 2**64), ("seed", 2**63 - 1),
    ("prompt", "a\ud800b"), ("stop", ["\udfff"]), ("user", "\ud800"), ("cache_salt", "\udfff"),
    ("temperature", 1e-40),  # last: today it kills the prefill worker, and every later case with it
]


def test_disaggregated_server_survives_hostile_values(disagg_server: Server) -> None:
    """The same API in front of separate prefill and decode processes: a hostile value is refused (4xx) or
    served, never a 5xx, and it never takes a worker down for everyone else."""
    failures = []
    for key, value in HOSTILE_ACROSS_PROCESSES:
        what = f"{key}={value!r:.40}"
        # a fresh connection each time: after an unhandled error the server closes the one it answered on
        with httpx.Client(base_url=disagg_server.url, timeout=120) as c:
            body = base_body(COMPLETIONS) | {key: value}
            r = post_json(c, COMPLETIONS, body)
            if r.status_code >= 500:
                failures.append(f"{what}: {r.status_code} {r.text[:200]}")
            else:
                check_any(r, COMPLETIONS, body, 2)
        with httpx.Client(base_url=disagg_server.url, timeout=120) as c:
            ok = post_json(c, COMPLETIONS, base_body(COMPLETIONS))
            if ok.status_code != 200 or c.get("/health").status_code != 200:
                failures.append(f"after {what} a normal request got {ok.status_code}: {ok.text[:200]}")
    with httpx.Client(base_url=disagg_server.url, timeout=120) as c:
        wait_until(lambda: all(w["free_pages"] == w["pool_pages"] for w in c.get("/info").json()["workers"]),
                   30, "pools at baseline")
    assert not failures, "\n".join(failures)


def test_openapi_paths_and_methods(http: httpx.Client) -> None:
    """Every operation the server documents answers; methods it does not document get a clean 405."""
    spec = http.get("/openapi.json").json()
    paths: dict[str, dict[str, Any]] = spec["paths"]
    assert {CHAT, COMPLETIONS, "/v1/models", "/health", "/info"} <= set(paths)
    for path, ops in paths.items():
        for method in ("GET", "POST", "PUT", "DELETE", "PATCH"):
            body = b"{}" if method != "GET" else None
            r = send(http, method, path, body, {"content-type": "application/json"})
            if method.lower() in ops:
                assert r.status_code < 500, (method, path, r.status_code, r.text[:300])
                if r.status_code != 200:
                    check_error(r, (method, path))
            else:
                err = check_error(r, (method, path))
                assert r.status_code == 405, (method, path, r.status_code, err)


@fuzz_settings(40)
@given(path=st.text(st.characters(codec="ascii", categories=["L", "N", "P"]), max_size=30),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"]))
def test_unknown_paths_are_openai_shaped(http: httpx.Client, path: str, method: str) -> None:
    url = "/v1/" + path.replace("?", "").replace("#", "").lstrip("/")
    known = {CHAT, COMPLETIONS, "/v1/models"}
    r = send(http, method, url, b"{}" if method not in ("GET", "OPTIONS") else None)
    if url.rstrip("/") in known or r.status_code == 307:  # a trailing slash redirects to the known path
        return
    check_error(r, (method, url))
    assert r.status_code in (404, 405), (method, url, r.status_code)


@fuzz_settings(6)
@given(stream=st.booleans(), path=st.sampled_from([CHAT, COMPLETIONS]))
def test_client_that_hangs_up_frees_its_pages(server: Server, http: httpx.Client, stream: bool,
                                              path: str) -> None:
    """A client that goes away mid-request (streamed or not) leaves nothing held: 400 tokens would take
    over ten seconds, the pages must be back within five."""
    body = base_body(path) | {"max_tokens": 400, "ignore_eos": True, "stream": stream}
    try:
        with httpx.Client(timeout=0.4) as c, c.stream("POST", server.url + path, json=body) as r:
            if r.status_code == 200 and stream:
                next(r.iter_lines())
    except httpx.TimeoutException:
        pass
    wait_until(lambda: at_baseline(http), 5, "pages freed after the client hung up")


def test_still_serves_correctly_after_fuzzing(http: httpx.Client) -> None:
    """Last in the module: the fuzzing left the server healthy, correct and holding no page."""
    wait_until(lambda: at_baseline(http), 30, "every KV page free after the fuzzing")
    assert http.get("/health").json() == {"status": "ok"}
    r = http.post(CHAT, json={"model": MODEL, "temperature": 0, "max_tokens": 20,
                              "messages": [{"role": "user",
                                            "content": "What is the capital of France? Answer in one sentence."}]})
    assert r.status_code == 200, r.text
    check_whole(r.json(), True, 20, False)
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    r = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "The first three planets are", "max_tokens": 4,
                                     "temperature": 0, "stream": True,
                                     "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    check_stream(r.text, False, 4, True)
    info = http.get("/info").json()
    assert info["free_pages"] == info["pool_pages"] and info["running"] == info["waiting"] == 0, info


@pytest.mark.parametrize("client", ["httpx", "openai", "urllib"])
def test_a_20_mb_body_reaches_common_clients_as_a_413(server: Server, client: str) -> None:
    """A client still sending when the server decides gets the 413, not a connection reset (issue 10)."""
    import urllib.error
    import urllib.request

    import openai

    filler = "word " * (4 * 2**20)  # 20 MB of prompt
    if client == "httpx":
        r = httpx.post(server.url + COMPLETIONS, json={**base_body(COMPLETIONS), "prompt": filler}, timeout=120)
        status, code = r.status_code, r.json()["error"]["code"]
    elif client == "openai":
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=MODEL, prompt=filler, max_tokens=1)
        status, code = e.value.status_code, e.value.code
    else:
        req = urllib.request.Request(server.url + COMPLETIONS, method="POST",
                                     data=json.dumps({**base_body(COMPLETIONS), "prompt": filler}).encode(),
                                     headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as h:
            urllib.request.urlopen(req, timeout=120)
        status, code = h.value.code, json.loads(h.value.read())["error"]["code"]
    assert (status, code) == (413, "payload_too_large")

"""n samples of one request (router/fanout.py, api/respond.py) over a scripted backend: sample 0 first and
the others after its first delta, one outcome for the whole request, and no sample left running when another
failed or sample 0 was refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import msgspec
import pytest
from fastapi.testclient import TestClient

from kvseal.api.app import build_app
from kvseal.api.http_errors import error_response
from kvseal.config import ServerConfig
from kvseal.errors import InvalidRequest, KvsealError, WorkerFailed
from kvseal.wire.messages import GenerateDelta, GenerateRequest

from .conftest import FakeTokenizer


class ScriptedBackend:
    """Sample k (request id suffix) yields `steps` tokens, one per 10 ms; `fail` maps a sample to the error its
    last delta carries instead of finishing. Records which samples started and which were closed unfinished."""

    model_name, context_window = "m", 256

    def __init__(self, steps: dict[int, int], fail: dict[int, KvsealError] | None = None) -> None:
        self.tokenizer = FakeTokenizer()
        self.steps, self.fail = steps, fail or {}
        self.started: list[int] = []
        self.aborted: list[int] = []

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        k = int(req.request_id.rsplit("-", 1)[1]) if req.request_id.count("-") > 1 else 0
        self.started.append(k)
        done = False
        try:
            for i in range(self.steps[k]):
                await asyncio.sleep(0.01)
                yield GenerateDelta(req.request_id, [3 + k], "b", prompt_tokens=len(req.prompt_ids),
                                    completion_tokens=i + 1)
            err = self.fail.get(k)
            done = True
            if err is not None:
                yield GenerateDelta(req.request_id, [], "", final="failed", error=err.to_info())
            else:
                yield GenerateDelta(req.request_id, [], "", final="length", prompt_tokens=len(req.prompt_ids),
                                    completion_tokens=self.steps[k], cached_tokens=0 if k else 1)
        finally:
            if not done:
                self.aborted.append(k)

    async def info(self) -> dict[str, Any]:
        return {"role": "test"}

    async def healthy(self) -> bool:
        return True


BODY = {"model": "m", "prompt": "abc", "max_tokens": 8, "n": 3}


def test_n_samples_whole_and_streamed() -> None:
    backend = ScriptedBackend({0: 2, 1: 3, 2: 1})
    with TestClient(build_app(backend, ServerConfig())) as c:
        r = c.post("/v1/completions", json=BODY).json()
        assert [ch["index"] for ch in r["choices"]] == [0, 1, 2]
        assert [ch["text"] for ch in r["choices"]] == ["bb", "bbb", "b"]
        assert r["usage"]["completion_tokens"] == 6 and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 1
        assert backend.started[0] == 0 and sorted(backend.started) == [0, 1, 2]
        with c.stream("POST", "/v1/completions", json={**BODY, "stream": True,
                                                       "stream_options": {"include_usage": True}}) as s:
            events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        texts = ["".join(e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["index"] == i)
                 for i in range(3)]
        assert texts == ["bb", "bbb", "b"] and events[-1]["usage"]["completion_tokens"] == 6
    assert backend.aborted == []


def test_one_failed_sample_fails_the_request_and_aborts_the_others() -> None:
    backend = ScriptedBackend({0: 30, 1: 1, 2: 30}, fail={1: WorkerFailed("decode-1 died")})
    with TestClient(build_app(backend, ServerConfig())) as c:
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_failed"
    assert sorted(backend.aborted) == [0, 2]  # still running when sample 1 failed: closed, not left behind


def test_a_refused_sample_0_starts_no_other_sample() -> None:
    backend = ScriptedBackend({0: 0, 1: 1, 2: 1}, fail={0: InvalidRequest("prefill refused it", param="prompt")})
    with TestClient(build_app(backend, ServerConfig())) as c:
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        s = c.post("/v1/completions", json={**BODY, "stream": True})
        assert s.status_code == 400  # the error came first: a real status, not a 200 stream
    assert backend.started == [0, 0]


class RaisingBackend(ScriptedBackend):
    """Sample `bad` raises a plain exception (not a KvsealError) after its first delta: a backend bug."""

    def __init__(self, steps: dict[int, int], bad: int) -> None:
        super().__init__(steps)
        self.bad = bad

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        k = int(req.request_id.rsplit("-", 1)[1]) if req.request_id.count("-") > 1 else 0
        async for d in super().generate(req):
            yield d
            if k == self.bad:
                raise ValueError("'weird' is not a valid FinishReason")


@pytest.mark.parametrize("bad", [0, 1])
@pytest.mark.parametrize("stream", [False, True])
def test_an_unexpected_exception_in_any_sample_ends_the_request_with_one_error(bad: int, stream: bool) -> None:
    """Before: fanout caught only KvsealError; the sample's task died, no delta came, the client waited forever."""
    backend = RaisingBackend({0: 3, 1: 30, 2: 30}, bad=bad)

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(backend, ServerConfig()))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/v1/completions", json={**BODY, "stream": stream})

    async def within_20s() -> httpx.Response:
        try:
            return await asyncio.wait_for(ask(), 20)
        except TimeoutError:
            raise AssertionError("the client is still waiting for an answer after 20 s") from None

    r = asyncio.run(within_20s())
    if stream:  # a first delta came before the exception: a 200 stream that ends with one error event
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        assert r.status_code == 200 and "data: [DONE]" not in r.text
        assert [e["error"]["code"] for e in events if "error" in e] == ["internal_error"]
    else:
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
    assert sorted(backend.aborted) == sorted(backend.started) == [0, 1, 2]  # none left running, none finished


@pytest.mark.parametrize("status", [200, 204, 302, 0, -1, 600])
@pytest.mark.parametrize("stream", [False, True])
def test_a_peer_error_with_a_success_status_is_a_502(status: int, stream: bool) -> None:
    """Before: an error from a peer kept its status whatever it was, and a 200 went out with an error body."""
    info = WorkerFailed("the peer failed").to_info()
    backend = ScriptedBackend({0: 0}, fail={0: KvsealError.from_info(msgspec.structs.replace(info, status=status))})
    with TestClient(build_app(backend, ServerConfig())) as c:
        r = c.post("/v1/completions", json={**BODY, "n": 1, "stream": stream})
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_failed", (r.status_code, r.text)


def test_an_error_of_this_process_with_a_success_status_is_a_500() -> None:
    err = InvalidRequest("a handler bug")
    err.status = 200
    assert error_response(err).status_code == 500
    assert error_response(InvalidRequest("fine")).status_code == 400

"""n samples of one request (router/fanout.py, router/respond.py) over a scripted backend: sample 0 first and
the others after its first delta, one outcome for the whole request, and no sample left running when another
failed or sample 0 was refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

from fastapi.testclient import TestClient

from kvseal.config import ServerConfig
from kvseal.engine.messages import GenerateDelta, GenerateRequest
from kvseal.errors import InvalidRequest, KvsealError, WorkerFailed
from kvseal.router.api import build_app

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

"""`kvseal audit --tenant-keys` against tiny fake OpenAI servers with two keys (uvicorn in a background thread):

- sealed: a prefix cache, a response store and figures per tenant; /metrics for nobody but admins;
- leaky: one prefix cache for every key unless a cache_salt tells them apart (vLLM's way), one response store,
  /metrics labelled by tenant for every key, /slots showing each tenant's last prompt (llama.cpp's way), and
  503s for a tenant while another tenant's requests run;
- bare: no cache, no /v1/responses, no status pages.
Every probe must say held on sealed, broken on leaky (the prefix cache held there with --cache-salt-per-key) and
not_applicable where bare has nothing to probe; keys never appear in the output or the report.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from kvseal.audit.__main__ import main as audit_main
from tests.helpers.fake_http import serve

# timing verdicts (cache hits by time, latency under a flood), with wide margins: still run apart (scripts/test.sh)
pytestmark = [pytest.mark.integration, pytest.mark.serial]

KEYS = {"sk-fake-alice": "alice", "sk-fake-bob": "bob"}
ARGS = ["--tenant-keys", "sk-fake-alice,sk-fake-bob", "--probe-trials", "2", "--probe-chars", "300",
        "--noisy-samples", "3", "--flood-concurrency", "2", "--flood-chars", "2000", "--timeout", "20",
        "--seed", "5"]


def err(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": None}},
                        status_code=status)


def fake_app(mode: str) -> FastAPI:
    app = FastAPI()
    cache: set[tuple[str, ...]] = set()
    store: dict[tuple[str, ...], dict[str, Any]] = {}
    served: Counter[str] = Counter()
    in_flight: Counter[str] = Counter()
    last_prompt: dict[str, str] = {}

    def tenant(request: Request) -> str | None:
        return KEYS.get(request.headers.get("authorization", "").removeprefix("Bearer "))

    def scope(who: str, *rest: str) -> tuple[str, ...]:
        return rest if mode == "leaky" else (who, *rest)  # leaky: one namespace for every tenant

    @app.middleware("http")
    async def auth(request: Request, call_next: Any) -> Response:
        if tenant(request) is None:
            return err(401, "invalid api key")
        return await call_next(request)  # type: ignore[no-any-return]

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model", "max_model_len": 1024}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        who, body = tenant(request) or "", await request.json()
        tokens = len(body["prompt"]) // 4
        key = scope(who, str(body.get("cache_salt")), body["prompt"])
        hit = mode != "bare" and key in cache
        cache.add(key)
        await asyncio.sleep(0.005 if hit else 0.08)
        usage: dict[str, Any] = {"prompt_tokens": tokens, "completion_tokens": 1, "total_tokens": tokens + 1}
        if mode != "bare":
            usage["prompt_tokens_details"] = {"cached_tokens": tokens - 1 if hit else 0}
        return JSONResponse({"choices": [{"index": 0, "text": " x", "finish_reason": "length"}], "usage": usage})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        who, body = tenant(request) or "", await request.json()
        if mode == "leaky" and any(n for t, n in in_flight.items() if t != who):
            return err(503, "busy with another tenant's work")
        last_prompt[who] = body["messages"][-1]["content"]
        in_flight[who] += 1
        try:
            await asyncio.sleep(0.3 if len(last_prompt[who]) > 500 else 0.01)
        finally:
            in_flight[who] -= 1
        served[who] += 1
        return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                          "finish_reason": "stop"}]})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await request.json()
        return {"count": len(body["prompt"]) // 4, "tokens": [1] * (len(body["prompt"]) // 4)}

    if mode == "bare":
        return app

    @app.post("/v1/responses")
    async def create(request: Request) -> JSONResponse:
        who, body = tenant(request) or "", await request.json()
        prev = body.get("previous_response_id")
        if prev is not None and scope(who, prev) not in store:
            return err(404, f"Response with id '{prev}' not found.")
        rid = f"resp_{len(store) + 1:04d}"
        out = {"id": rid, "object": "response", "output": [{"type": "message", "content": [
            {"type": "output_text", "text": "OK " + json.dumps(store.get(scope(who, prev or "")))}]}]}
        if body.get("store", True):
            store[scope(who, rid)] = {**out, "input": body["input"]}
        return JSONResponse(out)

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str, request: Request) -> JSONResponse:
        found = store.get(scope(tenant(request) or "", rid))
        return JSONResponse(found) if found is not None else err(404, f"Response with id '{rid}' not found.")

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str, request: Request) -> JSONResponse:
        if store.pop(scope(tenant(request) or "", rid), None) is None:
            return err(404, f"Response with id '{rid}' not found.")
        return JSONResponse({"id": rid, "deleted": True})

    @app.get("/info")
    async def info(request: Request) -> dict[str, Any]:
        who = tenant(request) or ""
        return {"model": "fake-model", "tenant": who, "requests": {"completed": served[who]}}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if mode == "sealed":
            return err(403, "/metrics is for admin keys only")
        return PlainTextResponse("".join(f'fake:requests_total{{tenant="{t}"}} {n}\n' for t, n in served.items()))

    @app.get("/slots")
    async def slots() -> Response:
        if mode == "sealed":
            return err(404, "no such route")
        return JSONResponse([{"id": i, "prompt": p} for i, p in enumerate(last_prompt.values())])

    return app


@pytest.fixture(scope="module", params=["sealed", "leaky", "bare"])
def fake(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    for url in serve(fake_app(request.param)):
        yield request.param, url


def audit(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict[str, str],
                                                                                              dict[str, Any]]:
    out = tmp_path / "tenants.json"
    code = audit_main([url, *ARGS, *extra, "--report", str(out)])
    text = out.read_text()
    printed = capsys.readouterr()
    assert not re.search("sk-fake", text + printed.out + printed.err)  # keys are never printed or written
    report = json.loads(text)
    return code, {p["probe"]: p["verdict"] for p in report["probes"]}, report


EXPECTED = {
    "sealed": (0, {"prefix_cache": "held", "stored_responses": "held", "status_pages": "held",
                   "noisy_neighbour": "held"}),
    "leaky": (1, {"prefix_cache": "broken", "stored_responses": "broken", "status_pages": "broken",
                  "noisy_neighbour": "broken"}),
    "bare": (0, {"prefix_cache": "not_applicable", "stored_responses": "not_applicable",
                 "status_pages": "not_applicable", "noisy_neighbour": "held"}),
}


def test_each_probe_judges_the_fake_as_built(fake: tuple[str, str], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    mode, url = fake
    code, verdicts, report = audit(url, tmp_path, capsys)
    assert (code, verdicts) == EXPECTED[mode], json.dumps(report["probes"], indent=1)[:3000]
    assert report["unknown_key_status"] == 401
    evidence = {p["probe"]: p["evidence"] for p in report["probes"]}
    if mode == "leaky":
        summaries = {p["probe"]: p["summary"] for p in report["probes"]}
        assert all(what in summaries["stored_responses"] for what in ("read it", "continued it", "deleted it"))
        assert evidence["stored_responses"]["statuses"]["b_get"] == 200
        assert evidence["stored_responses"]["canary_in_b_get"]
        findings = " ".join(evidence["status_pages"]["findings"]["/metrics"])
        assert "A's tenant name" in findings and "alice" in findings
        assert any(f.startswith("A's canary") for f in evidence["status_pages"]["findings"]["/slots"])
        noisy = evidence["noisy_neighbour"]  # the first 503 settles it: B is not asked again
        assert noisy["tokenize_field"] == "prompt" and noisy["a_flood_answers"].get("/tokenize 200", 0) >= 1
        assert noisy["b_flooded_errors"] == noisy["b_flooded_taken"] == 1
        assert noisy["stopped_early"] == "B's request failed"
    if mode == "sealed":
        assert evidence["status_pages"]["a_tenant_name"] == "alice"
        assert evidence["prefix_cache"]["control_hit"] and evidence["prefix_cache"]["b_copy_cached_tokens"] == [0, 0]


def test_a_cache_salt_per_key_keeps_a_shared_cache_apart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for url in serve(fake_app("leaky")):
        code, verdicts, report = audit(url, tmp_path, capsys, "--probes", "prefix_cache", "--cache-salt-per-key")
        assert (code, verdicts) == (0, {"prefix_cache": "held"})
        assert report["probes"][0]["evidence"]["cache_salt_per_key"]


def test_a_refused_key_could_not_run(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    for url in serve(fake_app("sealed")):
        assert audit_main([url, "--tenant-keys", "sk-fake-alice,sk-nobody", "--report", str(out)]) == 2
    report = json.loads(out.read_text())
    assert report["verdict"] == "COULD NOT RUN" and report["probes"] == []
    assert report["error"].startswith("tenant B's key cannot complete a request: 401")
    assert "sk-nobody" not in out.read_text()

"""`kvseal audit` against tiny fake OpenAI servers on loopback (uvicorn in a background thread).

- good: echoes each request's own secret, rejects prompts above its window with a 400 context_length_exceeded;
- incident: what the GLM-5.3 incident looked like from outside: prompts above the window get a 200 whose text
  carries a secret of an EARLIER request (stale KV), in-window prompts behave;
- sloppy: plain-text 500s for over-window prompts and streams that stop without [DONE];
- nowindow: good, but /v1/models advertises no context window;
- slow: never answers in time (per-request timeouts and the whole-run deadline).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvseal.audit.__main__ import main as audit_main
from kvseal.cli import main as cli_main
from tests.helpers.fake_http import serve

pytestmark = pytest.mark.integration

WINDOW = 1024
SECRET = re.compile(r"\b([A-HJ-KM-NP-Z2-9]{8})\b")


def fake_app(mode: str) -> FastAPI:
    app = FastAPI()
    seen: list[str] = []  # secrets of earlier requests: the "stale KV" the incident server leaks

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card: dict[str, Any] = {"id": "fake-model", "object": "model"}
        if mode != "nowindow":  # like llama.cpp server: no window in /v1/models
            card["max_model_len"] = WINDOW
        return {"object": "list", "data": [card]}

    async def handle(request: Request, chat: bool) -> Response:
        body = await request.json()
        if mode == "slow":
            await asyncio.sleep(30)
        prompt = ("\n".join(m["content"] for m in body["messages"]) if chat else body["prompt"])
        tokens = len(prompt) // 4 + 1
        found = SECRET.findall(prompt)
        own = found[-1] if found else None
        over = tokens + int(body.get("max_tokens") or 16) > WINDOW
        if over and mode in ("good", "nowindow"):
            err = {"message": f"This model's maximum context length is {WINDOW} tokens; you requested {tokens}.",
                   "type": "invalid_request_error", "param": "prompt", "code": "context_length_exceeded"}
            return JSONResponse({"error": err}, status_code=400)
        if over and mode == "sloppy":
            return PlainTextResponse("Internal Server Error", status_code=500)
        if over and mode == "incident" and seen:
            text = f" {seen[len(seen) // 2]}\ncode:"  # a placeholder prefill over another request's pages
        elif own is not None:
            text = f" {own}\ncode: {own}"
        else:
            text = f" answer-{sum(map(ord, prompt)) % 997}"
        if own is not None:
            seen.append(own)
        await asyncio.sleep(0.002)
        usage = {"prompt_tokens": tokens, "completion_tokens": 8, "total_tokens": tokens + 8}
        if not body.get("stream"):
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return JSONResponse({"id": "x", "object": "chat.completion" if chat else "text_completion",
                                 "choices": [choice], "usage": usage})

        async def events() -> AsyncIterator[str]:
            for piece in (text[: len(text) // 2], text[len(text) // 2:]):
                delta: dict[str, Any] = {"delta": {"content": piece}} if chat else {"text": piece}
                yield f"data: {json.dumps({'choices': [{'index': 0, **delta, 'finish_reason': None}]})}\n\n"
                await asyncio.sleep(0.001)
            if mode != "sloppy":
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, False)

    return app


@pytest.fixture(scope="module")
def good() -> Iterator[str]:
    yield from serve(fake_app("good"))


@pytest.fixture(scope="module")
def incident() -> Iterator[str]:
    yield from serve(fake_app("incident"))


@pytest.fixture(scope="module")
def sloppy() -> Iterator[str]:
    yield from serve(fake_app("sloppy"))


ARGS = ["--requests", "40", "--concurrency", "8", "--over-window", "6", "--consistency-prompts", "4",
        "--timeout", "20", "--max-duration", "60", "--seed", "11"]


def test_good_server_passes(good: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "good.json"
    assert cli_main(["audit", good + "/v1", *ARGS, "--report", str(out)]) == 0  # through `kvseal audit`
    report = json.loads(out.read_text())
    assert report["verdict"] == "PASS" and report["violations"] == []
    assert report["model"] == "fake-model" and report["context_window"] == WINDOW
    assert report["calibrated"] and report["completed"] == report["planned"] == 40 + 6 + 8
    assert report["canary_echo"]["rate"] == 1.0
    assert report["over_window"]["results"] == {"400 context_length_exceeded": 6}
    assert report["consistency"]["compared"] == 4 and report["consistency"]["rate"] == 0.0
    assert set(report["by_kind"]) == {"chat", "chat+stream", "completion", "completion+stream"}
    # in-window prompts reach close to the window, and every one of them fit
    assert report["in_window_rejected"]["count"] == 0
    biggest = max(r["prompt_chars"] for r in report["requests"] if not r["over_window"])
    assert biggest // 4 > 0.6 * WINDOW
    printed = capsys.readouterr().out
    assert "verdict: PASS" in printed and "canary echo rate:      100.0%" in printed


def test_incident_server_fails_with_leaks_and_over_window_200(incident: str, tmp_path: Path) -> None:
    out = tmp_path / "incident.json"
    assert audit_main([incident, *ARGS, "--report", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["verdict"] == "FAIL"
    counts = report["violation_counts"]
    assert counts.get("leak", 0) >= 1 and counts.get("over_window_200") == 6
    leak = next(v for v in report["violations"] if v["kind"] == "leak")
    owner = next(r for r in report["requests"] if r["index"] == leak["evidence"]["owner"])
    assert owner["secret"] == leak["evidence"]["secret"] and owner["index"] != leak["request"]


def test_sloppy_server_fails_on_format(sloppy: str, tmp_path: Path) -> None:
    out = tmp_path / "sloppy.json"
    assert audit_main([sloppy, *ARGS, "--requests", "12", "--report", str(out)]) == 1
    counts = json.loads(out.read_text())["violation_counts"]
    assert counts.get("5xx_for_over_window") == 6 and counts.get("bad_error_format") == 6
    assert counts.get("broken_stream", 0) >= 1 and "leak" not in counts


def test_unreachable_server_exits_2(tmp_path: Path) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here now
    assert audit_main([f"http://127.0.0.1:{port}", "--report", str(tmp_path / "r.json")]) == 2
    assert audit_main(["ftp://127.0.0.1:1", "--report", str(tmp_path / "r.json")]) == 2


def test_run_deadline_cancels_and_exits_2(tmp_path: Path) -> None:
    gen = serve(fake_app("slow"))
    url = next(gen)
    out = tmp_path / "slow.json"
    try:
        t0 = time.monotonic()
        rc = audit_main([url, "--requests", "20", "--concurrency", "4", "--over-window", "2",
                         "--consistency-prompts", "0", "--timeout", "1", "--max-duration", "3", "--report", str(out)])
        assert time.monotonic() - t0 < 10
    finally:
        gen.close()
    assert rc == 2
    report = json.loads(out.read_text())
    assert report["verdict"] == "INCONCLUSIVE" and not report["calibrated"] and report["completed"] == 0
    outcomes = {r["outcome"] for r in report["requests"]}
    assert outcomes == {"timeout", "cancelled"} and report["cancelled"] > 0


def test_window_must_be_known(tmp_path: Path) -> None:
    gen = serve(fake_app("nowindow"))
    url = next(gen)
    out = tmp_path / "nowindow.json"
    try:
        assert audit_main([url, "--report", str(out)]) == 2 and not out.exists()
        assert audit_main([url, *ARGS, "--requests", "8", "--context-window", str(WINDOW),
                           "--report", str(out)]) == 0
    finally:
        gen.close()
    report = json.loads(out.read_text())
    assert report["window_source"] == "--context-window" and report["advertised_window"] is None

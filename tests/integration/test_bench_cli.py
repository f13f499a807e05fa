"""`kvseal bench` as a subprocess against a fake OpenAI streaming server on loopback.

The fake streams exactly max_tokens one-token chunks (a few ms apart) and then usage and [DONE], except:
prompts with REJECT get a 400, prompts with STREAMERR get one token then an error event, prompts with SHORT
stop after 2 tokens (a server that ignores ignore_eos). It records every body and how many requests were
in flight when each arrived (counted down before [DONE], so a client that waits for [DONE] sees it done).
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvseal.cli import main as cli_main
from tests.helpers.fake_http import serve

pytestmark = pytest.mark.integration

MODEL = "fake-bench"


class Fake:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.in_flight_at_arrival: list[int] = []
        self.in_flight = 0
        self.app = self._app()

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.handle(await request.json(), chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self.handle(await request.json(), chat=True)

        return app

    async def handle(self, body: dict[str, Any], chat: bool) -> Response:
        self.bodies.append(body)
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        if isinstance(text, str) and "REJECT" in text:
            return JSONResponse({"error": {"message": "rejected on purpose", "type": "invalid_request_error",
                                           "code": 400}}, status_code=400)
        self.in_flight += 1
        self.in_flight_at_arrival.append(self.in_flight)
        n = body["max_tokens"]
        if isinstance(text, str) and "SHORT" in text:
            n = 2
        prompt_tokens = len(text.split()) if isinstance(text, str) else len(text)

        def chunk(piece: str) -> str:
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            return f"data: {json.dumps({'choices': [{**choice, 'finish_reason': None}]})}\n\n"

        async def events() -> AsyncIterator[str]:
            try:
                if chat:  # like kvseal and vLLM: a role-only first chunk carries no output
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n"
                for i in range(n):
                    await asyncio.sleep(0.003)
                    yield chunk(f" t{i}")
                    if isinstance(text, str) and "STREAMERR" in text:
                        yield f"data: {json.dumps({'error': {'message': 'engine fault', 'code': 500}})}\n\n"
                        return
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            finally:
                self.in_flight -= 1
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def fake() -> Iterator[tuple[Fake, str]]:
    f = Fake()
    for url in serve(f.app):
        yield f, url


def bench(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvseal", "bench", "--base-url", url, "--no-progress", *args],
                          check=False, capture_output=True, text=True, timeout=120)


def test_fixed_sweep_all_complete(fake: tuple[Fake, str], tmp_path: Path) -> None:
    server, url = fake
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    p = bench(url + "/v1", "--dataset", "fixed", "--input-len", "32", "--output-len", "8", "--num-prompts", "6",
              "--max-concurrency", "1,3", "--goodput", "ttft:60000", "--result-json", str(out), "--plot", str(png),
              "--save-requests")
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert doc["model"] == MODEL and doc["sweep_key"] == "max_concurrency" and "cores" in doc["machine"]
    assert [ps["level"]["max_concurrency"] for ps in doc["passes"]] == [1, 3]
    for ps in doc["passes"]:
        m = ps["metrics"]
        assert (m["completed"], m["failed"], m["short_outputs"]) == (6, 0, 0)
        assert (m["total_input_tokens"], m["total_output_tokens"]) == (6 * 32, 6 * 8)
        assert m["good_requests"] == 6 and m["ttft_median_ms"] > 0 and m["tpot_p99_ms"] > 0
        assert ps["errors"] == {}
        assert [r["output_tokens"] for r in ps["requests"]] == [8] * 6
        assert all(len(r["itl_ms"]) == 7 and r["error"] is None for r in ps["requests"])
    # 1 warm-up then 2 passes of 6; every measured body asks for exactly 8 tokens of 32 ids in the default range
    assert len(server.bodies) == 13
    for b in server.bodies[1:]:
        assert len(b["prompt"]) == 32 and all(1000 <= t < 20000 for t in b["prompt"])
        assert (b["max_tokens"], b["min_tokens"], b["ignore_eos"], b["temperature"]) == (8, 8, True, 0.0)
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True} and b["model"] == MODEL
    # both passes send the same prompts (arrival order at concurrency 3 is up to the scheduler, so compare as sets)
    assert sorted(b["prompt"] for b in server.bodies[1:7]) == sorted(b["prompt"] for b in server.bodies[7:])
    assert server.in_flight_at_arrival[1:7] == [1] * 6  # concurrency 1: strictly one after another
    assert max(server.in_flight_at_arrival[7:]) <= 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "| output tok/s" in p.stdout and "c=1" in p.stdout and "c=3" in p.stdout
    assert "| goodput (req/s)" in p.stdout


def test_failures_are_counted_and_exit_1(fake: tuple[Fake, str], tmp_path: Path) -> None:
    server, url = fake
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": "alpha one", "output_len": 6}, {"prompt": "REJECT beta", "output_len": 4},
            {"prompt": "gamma three words"}, {"prompt": "SHORT delta", "output_len": 6},
            {"prompt": "STREAMERR eps", "output_len": 3}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "r.json"
    p = bench(url, "--endpoint", "chat", "--dataset", "jsonl", "--dataset-path", str(data), "--output-len", "5",
              "--num-prompts", "10", "--request-rate", "200", "--max-concurrency", "4", "--result-json", str(out))
    assert p.returncode == 1, p.stderr
    (ps,) = json.loads(out.read_text())["passes"]
    m = ps["metrics"]
    # the file twice: REJECT and STREAMERR fail, SHORT completes with 2 of 6 tokens
    assert (m["num_requests"], m["completed"], m["failed"], m["short_outputs"]) == (10, 6, 4, 2)
    assert m["total_output_tokens"] == 2 * (6 + 5 + 2)
    assert m["total_input_tokens"] == 2 * (2 + 3 + 2)  # the server's usage.prompt_tokens
    errors = ps["errors"]
    assert sum(errors.values()) == 4
    assert [v for k, v in errors.items() if k.startswith("HTTP 400") and "rejected on purpose" in k] == [2]
    assert errors["stream error: engine fault"] == 2
    assert all(b["messages"][0]["role"] == "user" and b["ignore_eos"] for b in server.bodies)
    assert "completed / failed" in p.stdout and "6 / 4" in p.stdout


def test_unreachable_or_bad_flags_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here now
    assert cli_main(["bench", "--base-url", f"http://127.0.0.1:{port}", "--no-progress", "--num-prompts", "2"]) == 2
    assert "cannot reach" in capsys.readouterr().err
    assert cli_main(["bench", "--max-concurrency", "1,x"]) == 2
    assert cli_main(["bench", "--dataset", "jsonl", "--dataset-path", str(tmp_path / "missing.jsonl")]) == 2


def test_rejected_warmup_exits_2(fake: tuple[Fake, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, url = fake
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "REJECT first"}) + "\n")
    assert cli_main(["bench", "--base-url", url, "--endpoint", "chat", "--dataset", "jsonl", "--dataset-path",
                     str(data), "--no-progress"]) == 2
    assert "warm-up request failed" in capsys.readouterr().err

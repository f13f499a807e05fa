"""The audit's HTTP side: discover the model and window, calibrate prompt sizes, send requests under load.

Contacts only the base URL it is given (no proxies from the environment, no redirects, no retries). Every
request has a timeout; a whole phase has a deadline after which what is still running is cancelled and
reported as cancelled.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvseal.audit.canary import (
    RequestSpec,
    Sizing,
    completion_prompt,
    error_problem,
    filler,
    make_secret,
    request_body,
)

WINDOW_FIELDS = ("max_model_len", "context_length", "context_window", "max_context_length")


class AuditSetupError(Exception):
    """The audit cannot run (server unreachable, no model, no known context window): exit code 2."""


@dataclass
class Result:
    spec: RequestSpec
    outcome: str  # ok | http_error | stream_error | timeout | transport_error | cancelled
    status: int | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    text: str = ""
    error: dict[str, Any] | None = None  # the OpenAI error object (or what came instead)
    problems: list[str] = field(default_factory=list)  # protocol problems: malformed bodies, broken streams
    finish_reason: str | None = None
    prompt_tokens: int | None = None  # as the server counted them (usage), when it said
    prompt_chars: int = 0


def make_client(base_url: str, timeout: float, concurrency: int, api_key: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=base_url, headers=headers, trust_env=False, follow_redirects=False,
        timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
        limits=httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2))


async def discover(client: httpx.AsyncClient, model: str | None, timeout: float) -> tuple[str, int | None, str]:
    """(model id, advertised context window or None, which field said so) from GET /v1/models."""
    try:
        r = await asyncio.wait_for(client.get("/v1/models"), timeout)
    except (httpx.HTTPError, TimeoutError) as exc:
        raise AuditSetupError(f"cannot reach {client.base_url}v1/models: {exc!r}") from exc
    if r.status_code != 200:
        raise AuditSetupError(f"GET /v1/models answered {r.status_code}: {r.text[:200]}")
    try:
        cards = [c for c in r.json().get("data", []) if isinstance(c, dict) and isinstance(c.get("id"), str)]
    except (ValueError, AttributeError) as exc:
        raise AuditSetupError(f"GET /v1/models did not return an OpenAI model list: {r.text[:200]}") from exc
    if model is None:
        if not cards:
            raise AuditSetupError("GET /v1/models lists no model; pass --model")
        card = cards[0]
    else:
        card = next((c for c in cards if c["id"] == model), {"id": model})
    for name in WINDOW_FIELDS:
        meta = card.get("meta")
        for where in (card, meta if isinstance(meta, dict) else {}):
            v = where.get(name)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return card["id"], v, name
    return card["id"], None, ""


async def calibrate(client: httpx.AsyncClient, model: str, window: int, timeout: float) -> tuple[float | None, str]:
    """Characters per token of the audit's own prompts, measured from the server's usage.prompt_tokens.
    Returns (ratio or None, the calibration request's secret: it joins the leak check)."""
    rng = random.Random()
    secret = make_secret(rng)
    prompt = completion_prompt(secret, filler(max(min(2400, window // 2 - 80), 0), secret, rng))
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    try:
        r = await asyncio.wait_for(client.post("/v1/completions", json=body), timeout)
        tokens = r.json()["usage"]["prompt_tokens"] if r.status_code == 200 else None
    except (TimeoutError, httpx.HTTPError, ValueError, KeyError, TypeError):
        tokens = None
    if not isinstance(tokens, int) or tokens <= 0:
        return None, secret
    return len(prompt) / tokens, secret


def _choice_text(obj: dict[str, Any], chat: bool, stream: bool) -> tuple[str, str | None]:
    choices = obj.get("choices")
    if not isinstance(choices, list):
        raise TypeError("no choices list")
    text, finish = "", None
    for ch in choices:
        if chat:
            part = (ch.get("delta") if stream else ch.get("message")) or {}
            piece = part.get("content")
        else:
            piece = ch.get("text")
        if piece is not None and not isinstance(piece, str):
            raise ValueError("choice text is not a string")
        text += piece or ""
        finish = ch.get("finish_reason") or finish
    return text, finish


def _error_result(res: Result, status: int, raw: bytes) -> Result:
    res.outcome, res.status = "http_error", status
    try:
        body: Any = json.loads(raw)
    except ValueError:
        res.error = {"raw": raw[:300].decode("utf-8", "replace")}
        res.problems.append(f"HTTP {status} body is not JSON")
        return res
    problem = error_problem(body)
    if problem:
        res.problems.append(f"HTTP {status}: {problem}")
    err = body.get("error") if isinstance(body, dict) else None
    res.error = err if isinstance(err, dict) else {"raw": body}
    return res


async def _send(client: httpx.AsyncClient, spec: RequestSpec, body: dict[str, Any], res: Result) -> Result:
    path = "/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions"
    chat, t0 = spec.endpoint == "chat", time.monotonic()
    if not spec.stream:
        r = await client.post(path, json=body)
        res.latency_s = time.monotonic() - t0
        if r.status_code != 200:
            return _error_result(res, r.status_code, r.content)
        res.status = 200
        try:
            obj = r.json()
            res.text, res.finish_reason = _choice_text(obj, chat, False)
            usage = obj.get("usage") or {}
            res.prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
            res.outcome = "ok"
        except (ValueError, AttributeError, TypeError) as exc:
            res.outcome = "ok"
            res.problems.append(f"HTTP 200 body is not an OpenAI completion: {exc}; {r.text[:200]!r}")
        return res
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raw = await r.aread()
            res.latency_s = time.monotonic() - t0
            return _error_result(res, r.status_code, raw)
        res.status = 200
        parts: list[str] = []
        try:
            done, errored = await _read_stream(r, chat, t0, res, parts)
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            done, errored = False, False
            res.problems.append(f"stream broke off: {exc!r}")
        res.text, res.latency_s = "".join(parts), time.monotonic() - t0
        if not done and not errored:
            res.problems.append("stream ended without [DONE] and without an error event")
        res.outcome = "ok" if done else "stream_error"
        return res


async def _read_stream(r: httpx.Response, chat: bool, t0: float, res: Result, parts: list[str]) -> tuple[bool, bool]:
    """A streamed answer's events into `parts` (its text so far) and res: (ended with [DONE], ended with an error
    event). Raises what the connection raises when it breaks off."""
    async for line in r.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return True, False
        try:
            obj = json.loads(data)
            if not isinstance(obj, dict):
                raise TypeError("not an object")
        except (ValueError, TypeError):
            res.problems.append(f"stream chunk is not a JSON object: {data[:120]!r}")
            continue
        if "error" in obj or obj.get("object") == "error":
            problem = error_problem(obj)
            if problem:
                res.problems.append(f"stream error event: {problem}")
            res.error = obj.get("error") if isinstance(obj.get("error"), dict) else {"raw": obj}
            return False, True
        if isinstance(obj.get("usage"), dict):
            res.prompt_tokens = obj["usage"].get("prompt_tokens")
        try:
            piece, finish = _choice_text(obj, chat, True)
        except (ValueError, AttributeError, TypeError) as exc:
            res.problems.append(f"stream chunk is not an OpenAI chunk: {exc}")
            continue
        if piece and res.ttft_s is None:
            res.ttft_s = time.monotonic() - t0
        parts.append(piece)
        res.finish_reason = finish or res.finish_reason
    return False, False


async def run_one(client: httpx.AsyncClient, spec: RequestSpec, sizing: Sizing, model: str, seed: int,
                  timeout: float) -> Result:
    body = request_body(spec, sizing, model, seed)
    res = Result(spec, "transport_error",
                 prompt_chars=sum(len(m["content"]) for m in body["messages"]) if "messages" in body
                 else len(body["prompt"]))
    try:
        return await asyncio.wait_for(_send(client, spec, body, res), timeout)
    except (TimeoutError, httpx.TimeoutException):
        res.outcome = "timeout"
    except httpx.HTTPError as exc:
        res.outcome = "transport_error"
        res.error = {"raw": repr(exc)}
    return res


async def run_phase(client: httpx.AsyncClient, specs: list[RequestSpec], sizing: Sizing, model: str, seed: int,
                    timeout: float, concurrency: int, deadline: float, label: str) -> list[Result]:
    """Runs `specs` with at most `concurrency` in flight (1: strictly one after another) until `deadline`
    (a time.monotonic() value); what has not finished by then is cancelled and reported as cancelled."""
    sem = asyncio.Semaphore(concurrency)
    done_count = 0
    step = max(len(specs) // 10, 1)

    async def guarded(spec: RequestSpec) -> Result:
        nonlocal done_count
        async with sem:
            out = await run_one(client, spec, sizing, model, seed, timeout)
        done_count += 1
        if done_count % step == 0 or done_count == len(specs):
            print(f"audit {label}: {done_count}/{len(specs)} done", file=sys.stderr, flush=True)
        return out

    tasks = [asyncio.ensure_future(guarded(s)) for s in specs]
    if not tasks:
        return []
    _, pending = await asyncio.wait(tasks, timeout=max(deadline - time.monotonic(), 0.0))
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    out: list[Result] = []
    for t, s in zip(tasks, specs):
        if t.cancelled():
            out.append(Result(s, "cancelled"))
        elif t.exception() is not None:  # a bug or an unexpected client error: say so, do not hide it
            out.append(Result(s, "transport_error", error={"raw": repr(t.exception())}))
        else:
            out.append(t.result())
    return out

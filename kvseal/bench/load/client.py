"""The HTTP side of `kvseal bench`: the request body, one streamed request, and one pass under load.

One httpx.AsyncClient serves a whole run (see kvseal.audit.runner.make_client: no proxies from the
environment, no redirects, no retries, a connection limit above the concurrency). A request never raises:
whatever goes wrong ends up as its error string, so every request of a pass is counted.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx
from tqdm import tqdm

from kvseal.bench.load.config import Endpoint, Level
from kvseal.bench.load.dataset import Prompt
from kvseal.bench.load.metrics import RequestResult
from kvseal.bench.load.schedule import arrival_offsets


def request_body(endpoint: Endpoint, model: str, p: Prompt) -> tuple[str, dict[str, Any]]:
    """(path, body): greedy, exactly output_len tokens (min = max, ignore_eos), streamed with usage at the end."""
    body: dict[str, Any] = {"model": model, "max_tokens": p.output_len, "min_tokens": p.output_len,
                            "ignore_eos": True, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        return "/v1/chat/completions", {**body, "max_completion_tokens": p.output_len,
                                        "messages": [{"role": "user", "content": p.prompt}]}
    return "/v1/completions", {**body, "prompt": p.prompt}


def chunk_output(obj: dict[str, Any], chat: bool) -> str:
    """The generated text a stream chunk carries (chat: content and reasoning_content of the delta)."""
    pieces: list[Any] = []
    for ch in obj.get("choices") or []:
        if chat:
            delta = ch.get("delta") or {}
            pieces += [delta.get("content"), delta.get("reasoning_content")]
        else:
            pieces.append(ch.get("text"))
    return "".join(p for p in pieces if isinstance(p, str))


def _error_message(obj: dict[str, Any]) -> str:
    err = obj.get("error")
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])[:300]
    return str(err if err is not None else obj.get("message", obj))[:300]


async def send_one(client: httpx.AsyncClient, path: str, body: dict[str, Any], res: RequestResult,
                   chat: bool) -> RequestResult:
    """Send one streamed request and fill `res` in: chunk arrival times, usage, and the error if any."""
    res.t_send = time.monotonic()
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                raw = await r.aread()
                res.error = f"HTTP {r.status_code}: {raw[:300].decode('utf-8', 'replace')}"
                return res
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                now, data = time.monotonic(), line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if not isinstance(obj, dict):
                    raise TypeError(f"not a JSON object: {data[:100]!r}")
                if "error" in obj or obj.get("object") == "error":
                    res.error = f"stream error: {_error_message(obj)}"
                    return res
                if chunk_output(obj, chat):
                    res.arrivals.append(now)
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    res.usage_prompt = usage.get("prompt_tokens", res.usage_prompt)
                    res.usage_completion = usage.get("completion_tokens", res.usage_completion)
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                        res.usage_cached = details["cached_tokens"]
            if not done:
                res.error = "stream ended before [DONE]"
    except httpx.TimeoutException as exc:
        res.error = f"timeout ({type(exc).__name__})"
    except httpx.HTTPError as exc:
        res.error = f"transport error: {type(exc).__name__}: {exc}"
    except (ValueError, TypeError, AttributeError) as exc:
        res.error = f"malformed stream chunk: {exc}"
    finally:
        res.t_end = time.monotonic()
    return res


async def run_pass(client: httpx.AsyncClient, endpoint: Endpoint, model: str, level: Level,
                   prompts: Sequence[Prompt], seed: int, progress: bool,
                   label: str) -> tuple[list[RequestResult], float, float]:
    """Send `prompts` at the level's arrival times, at most max_concurrency in flight (a request that arrives
    while the cap is reached waits, and its clock starts when it is sent). Returns (results in prompt order,
    the pass's monotonic start, its wall time in seconds)."""
    offsets = arrival_offsets(len(prompts), level.request_rate, random.Random(seed))
    sem = asyncio.Semaphore(level.max_concurrency or len(prompts))
    chat = endpoint == "chat"
    bar = tqdm(total=len(prompts), desc=label, unit="req", file=sys.stderr, disable=not progress)
    t0 = time.monotonic()

    async def one(i: int, p: Prompt, offset: float) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
        path, body = request_body(endpoint, model, p)
        async with sem:
            res = await send_one(client, path, body, RequestResult(i, p.input_len, p.output_len), chat)
        bar.update(1)
        return res

    try:
        results = await asyncio.gather(*(one(i, p, off) for i, (p, off) in enumerate(zip(prompts, offsets))))
    finally:
        bar.close()
    return list(results), t0, time.monotonic() - t0

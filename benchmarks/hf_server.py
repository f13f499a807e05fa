"""A minimal OpenAI-compatible server around Hugging Face transformers: the "what you would otherwise use"
baseline for `kvseal bench` (see docs/baselines.md). Not part of kvseal's serving path.

    python -m benchmarks.hf_server --port 8001 [--dtype float32|bfloat16] [--max-batch 32]

Model: transformers' LlamaForCausalLM (or Qwen2) with the weights of the GGUF (default: the bundled
SmolLM2-135M-Instruct), built by `benchmarks.common.hf_model` exactly as `benchmarks.engine_vs_hf`'s
transformers baseline does; the e2e tests check those weights match transformers' own GGUF loader.

Batching is STATIC: a background thread takes the requests that are waiting (up to --max-batch, after
gathering for --batch-window-ms), left-pads them into one batch, prefills it in one forward pass and then
decodes it step by step with a DynamicCache (the same forward calls `generate` makes). Requests that
arrive meanwhile wait until the whole batch has finished; finished rows leave the batch (their cache rows
are dropped) but no new row joins it. Every decode step's tokens are streamed as they are produced, so
TTFT and inter-token latency are real.

API: GET /health, GET /v1/models, POST /v1/completions with prompt as a string or a list of token ids,
max_tokens, min_tokens, temperature (0 = greedy), top_p, seed, ignore_eos, stream and
stream_options.include_usage. Each choice (and stream chunk) also carries the generated "token_ids". Not
supported (400): n > 1, logprobs, echo, stop, best_of, suffix, lists of prompts. The "model" field is not checked.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
import queue
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from benchmarks.common import hf_model, left_pad
from kvseal.api.openai_format import Choice, ResponseBuilder, usage

log = logging.getLogger("benchmarks.hf_server")

# An event for one request: ("token", id) for each generated token, then ("end", finish_reason) or
# ("error", message).
Event = tuple[str, Any]


@dataclass
class Job:
    """One request as the batching thread sees it."""

    prompt: list[int]
    max_tokens: int
    emit: Callable[[Event], None]
    min_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False
    seed: int | None = None
    cancelled: bool = False  # set by the HTTP side when the client went away
    generated: int = 0
    generator: torch.Generator | None = field(default=None, repr=False)


def _forward_kwargs(model: Any) -> tuple[str, str | None]:
    """The cache argument's name (transformers 5: `cache`, 4.x: `past_key_values`) and the keep-last-logits
    argument's name (`logits_to_keep`, older `num_logits_to_keep`, or None)."""
    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
    return cache_kw, keep_kw


class BatchDecoder:
    """Runs one static batch of Jobs to completion: prefill, then one forward per generated token."""

    def __init__(self, model: Any, eos_ids: Sequence[int], pad_id: int) -> None:
        self.model = model
        self.eos_ids = list(eos_ids)
        self.pad_id = pad_id
        self.cache_kw, self.keep_kw = _forward_kwargs(model)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor:
        kw: dict[str, Any] = {self.cache_kw: cache, "use_cache": True}
        if self.keep_kw:
            kw[self.keep_kw] = 1
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, **kw)
        return out.logits[:, -1, :].float()

    def _pick(self, logits: torch.Tensor, jobs: Sequence[Job]) -> list[int]:
        for i, j in enumerate(jobs):  # EOS may not end a request before min_tokens (as min_new_tokens)
            if j.generated < j.min_tokens and not j.ignore_eos:
                logits[i, self.eos_ids] = float("-inf")
        picked = logits.argmax(dim=-1).tolist()
        for i, j in enumerate(jobs):
            if j.temperature > 0:
                probs = torch.softmax(logits[i] / j.temperature, dim=-1)
                if j.top_p < 1.0:
                    sorted_p, order = probs.sort(descending=True)
                    keep = sorted_p.cumsum(0) - sorted_p < j.top_p  # always keeps the most likely token
                    probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
                picked[i] = int(torch.multinomial(probs, 1, generator=j.generator).item())
        return [int(t) for t in picked]

    def run(self, jobs: list[Job]) -> None:
        from transformers import DynamicCache

        for j in jobs:
            if j.temperature > 0:
                j.generator = torch.Generator()
                j.generator.manual_seed(j.seed if j.seed is not None else int.from_bytes(uuid.uuid4().bytes[:4]))
        ids, mask_l = left_pad([j.prompt for j in jobs], self.pad_id)
        mask = torch.tensor(mask_l)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        live = list(jobs)
        with torch.inference_mode():
            logits = self._forward(torch.tensor(ids), mask, pos, cache)
            while True:
                tokens = self._pick(logits, live)
                keep: list[int] = []
                for i, (j, t) in enumerate(zip(live, tokens)):
                    if j.cancelled:
                        continue
                    j.generated += 1
                    j.emit(("token", t))
                    if j.generated >= j.max_tokens:
                        j.emit(("end", "length"))
                    elif t in self.eos_ids and not j.ignore_eos:
                        j.emit(("end", "stop"))
                    else:
                        keep.append(i)
                if not keep:
                    return
                if len(keep) < len(live):  # finished rows leave the batch
                    index = torch.tensor(keep)
                    cache.batch_select_indices(index)
                    mask, pos = mask[index], pos[index]
                    live = [live[i] for i in keep]
                    tokens = [tokens[i] for i in keep]
                mask = torch.cat([mask, torch.ones(len(live), 1, dtype=mask.dtype)], dim=1)
                pos = pos[:, -1:] + 1
                logits = self._forward(torch.tensor(tokens).unsqueeze(1), mask, pos, cache)


class Batcher:
    """The background thread: gathers waiting Jobs into batches of at most max_batch and runs them."""

    def __init__(self, decoder: BatchDecoder, max_batch: int, window_s: float) -> None:
        self.decoder = decoder
        self.max_batch = max_batch
        self.window_s = window_s
        self.waiting: queue.Queue[Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="hf-batcher", daemon=True)
        self.batches = 0

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.waiting.put(None)
        self.thread.join(timeout=60)

    def submit(self, job: Job) -> None:
        self.waiting.put(job)

    def _take(self) -> list[Job] | None:
        """Block for the first Job, then gather more for up to window_s; None means stop."""
        first = self.waiting.get()
        if first is None:
            return None
        batch = [first]
        deadline = time.monotonic() + self.window_s
        while len(batch) < self.max_batch:
            try:
                nxt = self.waiting.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if nxt is None:
                self.waiting.put(None)  # stop after this batch
                break
            batch.append(nxt)
        return [j for j in batch if not j.cancelled]

    def _loop(self) -> None:
        while (batch := self._take()) is not None:
            if not batch:
                continue
            self.batches += 1
            try:
                self.decoder.run(batch)
            except Exception as e:  # a failed batch fails its requests, not the server
                log.exception("batch of %d failed", len(batch))
                for j in batch:
                    j.emit(("error", f"{type(e).__name__}: {e}"))


# -- HTTP ------------------------------------------------------------------------------------------------

_UNSUPPORTED = ("logprobs", "echo", "stop", "best_of", "suffix")


class BadRequest(Exception):
    pass


def parse_completion(body: Any, encode: Callable[[str], list[int]], vocab_size: int,
                     max_context: int) -> dict[str, Any]:
    """Validate a /v1/completions body; returns the Job fields plus `stream` and `include_usage`."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    for key in _UNSUPPORTED:
        if body.get(key) not in (None, False, 0, [], ""):
            raise BadRequest(f"{key!r} is not supported by this baseline server")
    if body.get("n", 1) != 1:
        raise BadRequest("only n = 1 is supported")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        ids = encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
        ids = list(prompt)
        if not all(0 <= t < vocab_size for t in ids):
            raise BadRequest(f"token ids must be in [0, {vocab_size})")
    else:
        raise BadRequest("prompt must be a string or a non-empty list of token ids")
    if not ids:
        raise BadRequest("the prompt is empty")

    def number(key: str, default: Any, kind: type, lo: float, hi: float) -> Any:
        v = body.get(key, default)
        if v is None:
            v = default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
            raise BadRequest(f"{key} must be a number" if kind is float else f"{key} must be an integer")
        if not lo <= v <= hi:
            raise BadRequest(f"{key} must be in [{lo}, {hi}]")
        return kind(v)

    max_tokens = number("max_tokens", 16, int, 1, max_context)
    if len(ids) + max_tokens > max_context:
        raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context window "
                         f"({max_context})")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("seed must be an integer")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise BadRequest("stream_options must be an object")
    return {"prompt": ids, "max_tokens": max_tokens, "min_tokens": number("min_tokens", 0, int, 0, max_context),
            "temperature": number("temperature", 1.0, float, 0.0, 2.0),
            "top_p": number("top_p", 1.0, float, 0.0, 1.0), "ignore_eos": bool(body.get("ignore_eos", False)),
            "seed": seed, "stream": bool(body.get("stream", False)),
            "include_usage": bool(opts.get("include_usage", False))}


def build_app(batcher: Batcher, tokenizer: Any, model_name: str, max_context: int) -> FastAPI:
    app = FastAPI(title="kvseal-bench-hf", version="0.1.0")

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                            status_code=status)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "transformers", "max_model_len": max_context}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the body is not valid JSON")
        try:
            req = parse_completion(body, tokenizer.encode, tokenizer.vocab_size, max_context)
        except BadRequest as e:
            return error(400, str(e))
        stream, include_usage = req.pop("stream"), req.pop("include_usage")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        def emit(ev: Event) -> None:  # called on the batching thread
            loop.call_soon_threadsafe(events.put_nowait, ev)

        job = Job(emit=emit, **req)
        batcher.submit(job)
        builder = ResponseBuilder(f"cmpl-{uuid.uuid4().hex}", str(body.get("model") or model_name), chat=False,
                                  token_ids=True)
        n_prompt = len(job.prompt)

        async def deltas() -> AsyncIterator[tuple[str, str | None, int]]:
            """(text, finish_reason or None, token id or -1) per event; raises RuntimeError on an error."""
            decoder = tokenizer.incremental_decoder()
            while True:
                kind, value = await events.get()
                if kind == "token":
                    yield decoder.feed(value), None, value
                elif kind == "end":
                    yield decoder.flush(), value, -1
                    return
                else:
                    raise RuntimeError(value)

        if not stream:
            parts: list[str] = []
            ids: list[int] = []
            finish = "length"
            try:
                async for text, fin, tid in deltas():
                    parts.append(text)
                    if tid >= 0:
                        ids.append(tid)
                    finish = fin or finish
            except RuntimeError as e:
                return error(500, str(e), "internal_error")
            finally:
                job.cancelled = True  # a no-op once finished; stops the row if the client went away
            return JSONResponse(builder.whole([Choice("".join(parts), finish, None, ids)], usage(n_prompt, len(ids))))

        async def sse() -> AsyncIterator[str]:
            n = 0
            pending: list[int] = []  # ids whose text is not out yet (an incomplete UTF-8 character)
            try:
                async for text, fin, tid in deltas():
                    if tid >= 0:
                        n += 1
                        pending.append(tid)
                    if text or fin:
                        chunk = builder.chunk(text, fin, None, token_ids=pending)
                        pending = []
                        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
                    if fin and include_usage:
                        yield f"data: {json.dumps(builder.usage_chunk(usage(n_prompt, n)))}\n\n"
                yield "data: [DONE]\n\n"
            except RuntimeError as e:
                yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'internal_error'}})}\n\n"
            finally:
                job.cancelled = True

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="checkpoint (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--max-batch", type=int, default=32, help="most requests in one static batch")
    p.add_argument("--batch-window-ms", type=float, default=10.0,
                   help="how long the first waiting request waits for others to join its batch")
    p.add_argument("--max-model-len", type=int, default=None, help="cap the context window (tokens)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--served-model-name", default=None, help="the id /v1/models reports (default: checkpoint name)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    a = p.parse_args(argv)
    if a.max_batch < 1:
        p.error("--max-batch must be at least 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import uvicorn

    from kvseal.model.loader import load_checkpoint

    logging.basicConfig(level=a.log_level.upper())
    if a.threads:
        torch.set_num_threads(a.threads)
    t = time.monotonic()
    ckpt = load_checkpoint(a.model, progress=False)
    model = hf_model(ckpt, a.dtype)
    tok = ckpt.tokenizer
    eos = list(tok.eos_ids)
    max_context = min(ckpt.arch.max_position, a.max_model_len or ckpt.arch.max_position)
    batcher = Batcher(BatchDecoder(model, eos, eos[0] if eos else 0), a.max_batch, a.batch_window_ms / 1000)
    batcher.start()
    name = a.served_model_name or ckpt.name
    print(f"hf_server: {name} ({a.dtype}, {torch.get_num_threads()} threads) loaded in "
          f"{time.monotonic() - t:.1f}s; http://{a.host}:{a.port}", file=sys.stderr, flush=True)
    try:
        uvicorn.run(build_app(batcher, tok, name, max_context), host=a.host, port=a.port,
                    log_level=a.log_level, access_log=False)
    finally:
        batcher.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

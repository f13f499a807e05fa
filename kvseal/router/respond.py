"""Deltas -> the HTTP answer: a whole JSON response or an SSE stream. Never a 200 for a request that did not
complete: a whole response is sent only after the final delta said FINISHED; a stream starts only after the
first delta arrived, and a later failure (or a backend that stops without a final delta) ends it with an error
event and no [DONE]. A client that leaves aborts the request on every worker it reached.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvseal.engine.messages import GenerateDelta, TokenLogprob
from kvseal.errors import InternalError, KvsealError, RequestAborted
from kvseal.model.tokenizer import Tokenizer
from kvseal.router.http_errors import failed
from kvseal.router.openai_format import ResponseBuilder, chat_logprobs, completion_logprobs, usage
from kvseal.router.requestlog import trace_of

Deltas = AsyncGenerator[GenerateDelta, None]


def format_lps(tok: Tokenizer, lps: list[TokenLogprob] | None, chat: bool, offset: int) -> dict[str, Any] | None:
    if lps is None:
        return None
    return chat_logprobs(tok, lps) if chat else completion_logprobs(tok, lps, offset)


async def until_done(request: Request, task: asyncio.Future[Any], gen: Deltas) -> bool:
    """Wait for task; False (task cancelled, request aborted, pages freed) when the client left first.
    A request queued for pages waits here too: a client that leaves frees everything it held."""
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await gen.aclose()  # aborts the request on every worker it reached
                return False
    finally:
        if not task.done():
            task.cancel()
    return True


async def whole(request: Request, tok: Tokenizer, gen: Deltas, builder: ResponseBuilder,
                chat: bool) -> JSONResponse:
    ids: list[int] = []

    async def collect() -> tuple[str, list[TokenLogprob] | None, GenerateDelta]:
        parts: list[str] = []
        lps: list[TokenLogprob] | None = None
        async for d in gen:
            parts.append(d.text)
            ids.extend(d.token_ids)
            if d.logprobs is not None:
                lps = (lps or []) + d.logprobs
            if d.final is not None:
                return "".join(parts), lps, d
        raise InternalError("the backend ended a request without an outcome")

    task = asyncio.ensure_future(collect())
    if not await until_done(request, task, gen):
        return failed(request, RequestAborted("client disconnected"))
    text, lps, last = task.result()
    if last.error is not None:
        return failed(request, KvsealError.from_info(last.error), last)
    use = usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
    return JSONResponse(builder.whole(text, last.final or "stop", format_lps(tok, lps, chat, 0), use, ids))


async def stream(request: Request, tok: Tokenizer, gen: Deltas, builder: ResponseBuilder, include_usage: bool,
                 chat: bool) -> Any:
    # Wait for the first delta before committing to a 200: an error that comes first is a real status.
    first_task = asyncio.ensure_future(gen.__anext__())
    if not await until_done(request, first_task, gen):
        return failed(request, RequestAborted("client disconnected"))
    try:
        first = first_task.result()
    except StopAsyncIteration:
        return failed(request, InternalError("the backend ended a request without an outcome"))
    if first.final is not None and first.error is not None:
        await gen.aclose()
        return failed(request, KvsealError.from_info(first.error), first)
    trace = trace_of(request.scope)

    async def events() -> AsyncIterator[str]:
        offset = 0
        d: GenerateDelta | None = first
        try:
            if chat:
                yield _sse(builder.chunk("", None, None, role=True))
            while d is not None:
                if d.error is not None:
                    err = KvsealError.from_info(d.error)
                    trace.failed(err.code, err.message, d.stage, d.worker)
                    trace.stream_error = True
                    yield _sse(err.to_openai())
                    return
                finish = d.final
                if d.text or d.logprobs or finish:
                    yield _sse(builder.chunk(d.text, finish, format_lps(tok, d.logprobs, chat, offset),
                                             token_ids=d.token_ids))
                    offset += len(d.text)
                if finish is not None:
                    if include_usage:
                        yield _sse(builder.usage_chunk(usage(d.prompt_tokens, d.completion_tokens,
                                                             d.cached_tokens)))
                    yield "data: [DONE]\n\n"
                    return
                d = await anext(gen, None)
            # the backend stopped without a final delta: the answer is incomplete, never a clean end
            err = InternalError("the backend ended the stream without an outcome; the answer is incomplete")
            trace.failed(err.code, err.message, None, None)
            trace.stream_error = True
            yield _sse(err.to_openai())
        finally:
            await gen.aclose()  # a disconnect cancels this generator: the request is aborted

    return StreamingResponse(events(), media_type="text/event-stream")


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

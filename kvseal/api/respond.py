"""Deltas -> the HTTP answer: a whole JSON response or an SSE stream, for one sample or n (router/fanout.py).

The API's shapes are apart: `gather` and `stream` take what each API writes (OpenAI's chat and completions below,
Anthropic's Messages in api/anthropic_format.py, OpenAI's Responses in api/responses_format.py).

Never a 200 for a request that did not complete: a whole response is sent only after every sample's final delta
said FINISHED; a stream starts only after the first delta arrived, and a later failure of any sample (or a
backend that stops without a final delta) ends it with an error event and no [DONE]. A client that leaves, or a
sample that fails, aborts every sample still running on every worker it reached.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvseal.api.http_errors import failed
from kvseal.api.openai_format import Choice, ResponseBuilder, chat_logprobs, completion_logprobs, usage
from kvseal.api.tools.output import StreamCalls, split_whole, whole_calls
from kvseal.api.tools.plan import ToolPlan
from kvseal.errors import InternalError, KvsealError, RequestAborted
from kvseal.model.tokenizer import Tokenizer
from kvseal.router.fanout import Fanout
from kvseal.tenancy.requestlog import trace_of
from kvseal.wire.messages import GenerateDelta, TokenLogprob

INCOMPLETE = "the backend ended a request without an outcome"


def format_lps(tok: Tokenizer, lps: list[TokenLogprob] | None, chat: bool, offset: int) -> dict[str, Any] | None:
    if lps is None:
        return None
    return chat_logprobs(tok, lps) if chat else completion_logprobs(tok, lps, offset)


def usage_of(finals: list[GenerateDelta]) -> dict[str, Any]:
    """finals: each sample's final delta, in sample order. The prompt counted once (and its cache hits: sample 0's,
    which computed it), completions summed."""
    return usage(finals[0].prompt_tokens, sum(d.completion_tokens for d in finals), finals[0].cached_tokens)


async def until_done(request: Request, task: asyncio.Future[Any], fan: Fanout) -> bool:
    """Wait for task; False (task cancelled, every sample aborted, pages freed) when the client left first.
    A request queued for pages waits here too: a client that leaves frees everything it held."""
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await fan.aclose()  # aborts the samples on every worker they reached
                return False
    finally:
        if not task.done():
            task.cancel()
    return True


@dataclass
class Sample:
    """One sample's whole answer as it came: text, ids, logprobs, and its final delta (FINISHED)."""

    parts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    lps: list[TokenLogprob] | None = None
    final: GenerateDelta | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)


async def gather(request: Request, fan: Fanout) -> list[Sample] | JSONResponse:
    """Every sample's whole answer, each FINISHED; or the error response when any did not finish."""
    samples = [Sample() for _ in range(fan.n)]

    async def collect() -> GenerateDelta | None:
        """None when every sample finished; else the first final delta with an error."""
        left = fan.n
        while left:
            i, d = await fan.next()
            if d is None:
                raise InternalError(INCOMPLETE)
            s = samples[i]
            s.parts.append(d.text)
            s.ids.extend(d.token_ids)
            if d.logprobs is not None:
                s.lps = (s.lps or []) + d.logprobs
            if d.final is not None:
                if d.error is not None:
                    return d
                s.final, left = d, left - 1
        return None

    task = asyncio.ensure_future(collect())
    try:
        if not await until_done(request, task, fan):
            return failed(request, RequestAborted("client disconnected"))
        bad = task.result()
    finally:
        await fan.aclose()  # the other samples of a failed request end too
    if bad is not None:
        assert bad.error is not None
        return failed(request, KvsealError.from_info(bad.error), bad)
    return samples


async def whole(request: Request, tok: Tokenizer, fan: Fanout, builder: ResponseBuilder,
                chat: bool, plan: ToolPlan | None = None) -> JSONResponse:
    samples = await gather(request, fan)
    if isinstance(samples, JSONResponse):
        return samples
    finals = [s.final for s in samples if s.final is not None]
    choices = []
    for s, f in zip(samples, finals):
        text, finish, calls = s.text, f.final or "stop", None
        if plan is not None:
            text, parsed = split_whole(plan.splitter(), text)
            if parsed:
                calls, finish = whole_calls(parsed), "tool_calls"
        choices.append(Choice(text, finish, format_lps(tok, s.lps, chat, 0), s.ids, calls))
    return JSONResponse(builder.whole(choices, usage_of(finals)))


class StreamFormat(Protocol):
    """What one API writes into a stream. Every method returns whole SSE events (text ready to send)."""

    def opening(self) -> list[str]: ...

    def delta(self, i: int, d: GenerateDelta) -> list[str]:
        """Sample i's delta (never one with an error; its final one included)."""
        ...

    def closing(self, finals: list[GenerateDelta]) -> list[str]:
        """After every sample's final delta (finals in sample order)."""
        ...

    async def settle(self) -> None:
        """After a final delta's events are made and before they go out (the Responses API stores the answer
        here, so a client that reads `completed` finds it stored)."""
        ...

    def error(self, err: KvsealError) -> str: ...


async def stream(request: Request, fan: Fanout, fmt: StreamFormat) -> Any:
    # Wait for the first delta before committing to a 200: an error that comes first is a real status.
    first_task = asyncio.ensure_future(fan.next())
    if not await until_done(request, first_task, fan):
        return failed(request, RequestAborted("client disconnected"))
    first = first_task.result()
    if first[1] is None:
        await fan.aclose()
        return failed(request, InternalError(INCOMPLETE))
    if first[1].final is not None and first[1].error is not None:
        await fan.aclose()
        return failed(request, KvsealError.from_info(first[1].error), first[1])
    trace = trace_of(request.scope)

    async def events() -> AsyncIterator[str]:
        finals: dict[int, GenerateDelta] = {}
        i, d = first
        try:
            for e in fmt.opening():
                yield e
            while True:
                if d is None:  # a backend stopped without a final delta: the answer is incomplete, never clean
                    err: KvsealError = InternalError("the backend ended the stream without an outcome; the "
                                                     "answer is incomplete")
                    trace.failed(err.code, err.message, None, None)
                    trace.stream_error = True
                    yield fmt.error(err)
                    return
                if d.error is not None:
                    err = KvsealError.from_info(d.error)
                    trace.failed(err.code, err.message, d.stage, d.worker)
                    trace.stream_error = True
                    yield fmt.error(err)
                    return
                out = fmt.delta(i, d)
                if d.final is not None:
                    try:
                        await fmt.settle()
                    except KvsealError as err:  # e.g. the answer could not be stored (the shared state is down)
                        trace.failed(err.code, err.message, d.stage, d.worker)
                        trace.stream_error = True
                        yield fmt.error(err)
                        return
                for e in out:
                    yield e
                if d.final is not None:
                    finals[i] = d
                    if len(finals) == fan.n:
                        for e in fmt.closing([finals[j] for j in range(fan.n)]):
                            yield e
                        return
                i, d = await fan.next()
        finally:
            await fan.aclose()  # a disconnect cancels this generator: every sample is aborted

    return StreamingResponse(events(), media_type="text/event-stream")


class OpenAIStream:
    """OpenAI's chat.completion.chunk / text_completion stream; with tools, content and calls as the family's
    splitter decides them (api/tools/)."""

    def __init__(self, tok: Tokenizer, builder: ResponseBuilder, n: int, include_usage: bool, chat: bool,
                 plan: ToolPlan | None) -> None:
        self.tok, self.builder, self.n, self.include_usage, self.chat = tok, builder, n, include_usage, chat
        self.offsets = [0] * n
        self.calls = [StreamCalls(plan.splitter()) for _ in range(n)] if plan is not None else None

    def opening(self) -> list[str]:
        return [sse(self.builder.chunk("", None, None, role=True, index=j)) for j in range(self.n)] if self.chat else []

    def delta(self, i: int, d: GenerateDelta) -> list[str]:
        if self.calls is not None:
            return [sse(c) for c in _tool_chunks(self.builder, self.calls[i], d, i)]
        if not (d.text or d.logprobs or d.final):
            return []
        out = sse(self.builder.chunk(d.text, d.final, format_lps(self.tok, d.logprobs, self.chat, self.offsets[i]),
                                     token_ids=d.token_ids, index=i))
        self.offsets[i] += len(d.text)
        return [out]

    async def settle(self) -> None:
        pass

    def closing(self, finals: list[GenerateDelta]) -> list[str]:
        use = [sse(self.builder.usage_chunk(usage_of(finals)))] if self.include_usage else []
        return [*use, "data: [DONE]\n\n"]

    def error(self, err: KvsealError) -> str:
        return sse(err.to_openai())


def _tool_chunks(builder: ResponseBuilder, calls: StreamCalls, d: GenerateDelta, i: int) -> list[dict[str, Any]]:
    out = [builder.chunk(text, None, None, index=i, tool_calls=tc) for text, tc in calls.deltas(d.text, bool(d.final))]
    if d.final is not None:
        out.append(builder.chunk(None, "tool_calls" if calls.calls else d.final, None, index=i))
    if builder.token_ids and d.token_ids:  # the delta's ids ride on its first chunk (or an empty one)
        if not out:
            out.append(builder.chunk(None, None, None, index=i))
        out[0]["choices"][0]["token_ids"] = d.token_ids
    return out


def sse(obj: dict[str, Any], event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, ensure_ascii=False)}\n\n"

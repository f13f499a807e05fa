"""The OpenAI HTTP API over any Backend. Every failure leaves here as OpenAI-shaped JSON with its status.

Never a 200 for a request that did not complete: a whole response is sent only after the final delta said
FINISHED; a stream starts only after the first delta arrived, and a later failure (or a backend that stops
without a final delta) ends it with an error event and no [DONE]. A 503 carries Retry-After. Every response
carries X-Request-Id, and every request that did not complete is logged once (router/requestlog.py).
Prompts are rendered and tokenized off the event loop (router/text.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvseal.config import ServerConfig
from kvseal.engine.messages import GenerateDelta, GenerateRequest, SamplingParams, TokenLogprob
from kvseal.errors import (
    ContextLengthExceeded,
    InternalError,
    InvalidRequest,
    KvsealError,
    ModelNotFound,
    NotFound,
    RequestAborted,
)
from kvseal.router.backend import Backend
from kvseal.router.bodylimit import BodyLimit
from kvseal.router.openai_format import ResponseBuilder, chat_logprobs, completion_logprobs, usage
from kvseal.router.protocol import ChatCompletionRequest, CompletionRequest, message_dicts
from kvseal.router.requestlog import RequestLog, trace_of
from kvseal.router.tenants import TenantAuth
from kvseal.router.text import encode_text, render_chat

log = logging.getLogger("kvseal.api")


RETRY_AFTER_S = 1  # what a 503 (overloaded, queue full, no worker serving) tells the client to wait


def error_response(err: KvsealError) -> JSONResponse:
    headers = {"retry-after": str(RETRY_AFTER_S)} if err.status == 503 else None
    return JSONResponse(err.to_openai(), status_code=err.status, headers=headers)


def failed(request: Request, err: KvsealError, last: GenerateDelta | None = None) -> JSONResponse:
    """The error response for a request that reached the backend, its stage and worker noted for the log."""
    trace_of(request.scope).failed(err.code, err.message, last.stage if last else None,
                                   last.worker if last else None)
    return error_response(err)


def build_app(backend: Backend, cfg: ServerConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        try:
            yield
        finally:
            await backend.stop()

    app = FastAPI(title="kvseal", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes)
    app.add_middleware(TenantAuth, api_keys=cfg.api_keys)  # added last: runs first, before any body is read
    app.add_middleware(RequestLog)  # added last: outermost, it sees every response

    @app.exception_handler(KvsealError)
    async def _kvseal_error(_: Request, err: KvsealError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = f"{loc}: {first.get('msg', 'invalid request')}" if loc else str(first.get("msg", "invalid"))
        return error_response(InvalidRequest(msg, param=loc or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(NotFound("no such endpoint"))
        err = InvalidRequest(str(exc.detail))
        err.status = exc.status_code
        return error_response(err)

    def tenant_of(request: Request) -> str:
        return str(request.state.tenant)  # set by TenantAuth: "" when the server has no --api-keys

    def check_model(name: str) -> None:
        if name != backend.model_name:
            shown = name.encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates stay printable
            raise ModelNotFound(f"The model `{shown}` does not exist. This server serves `{backend.model_name}`.",
                                param="model")

    async def encode(text: str, chat: bool) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"the {'messages' if chat else 'prompt'} are not valid UTF-8 text "
                                 f"(a lone surrogate at position {exc.start})",
                                 param="messages" if chat else "prompt") from None
        return await encode_text(backend.tokenizer, text, add_special_tokens=not chat)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = await backend.healthy()
        return JSONResponse({"status": "ok" if ok else "unhealthy"}, status_code=200 if ok else 503)

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return await backend.info()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": backend.model_name, "object": "model", "created": 0, "owned_by": "kvseal",
                "max_model_len": backend.context_window}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        tenant = tenant_of(request)
        check_model(body.model)
        try:
            text = await render_chat(backend.tokenizer, message_dicts(body.messages), body.add_generation_prompt)
        except ValueError as exc:
            raise InvalidRequest(f"messages: {exc}", param="messages") from exc
        ids = await encode(text, chat=True)
        top = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await run(request, body, ids, max_tokens, top, tenant, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        tenant = tenant_of(request)
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise InvalidRequest("only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await encode(prompt, chat=False)
        else:
            ids = [int(t) for t in prompt]
            if any(t >= backend.tokenizer.vocab_size for t in ids):
                raise InvalidRequest("a prompt token id is outside the vocabulary", param="prompt")
        return await run(request, body, ids, body.max_tokens, body.logprobs, tenant, chat=False)

    async def run(request: Request, body: ChatCompletionRequest | CompletionRequest, ids: list[int],
                  max_tokens: int | None, top_logprobs: int | None, tenant: str, chat: bool) -> Any:
        window = backend.context_window
        if not ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if max_tokens is None:
            max_tokens = max(window - len(ids), 1)
        if len(ids) + max_tokens > window:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {window} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the completion). "
                f"Please reduce the length of the prompt or completion.", param="messages" if chat else "prompt")
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(body.top_k or 0, 0),
            seed=body.seed,
            stop=body.stop_list(),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=top_logprobs,
            min_tokens=body.min_tokens,
        )
        rid = ("chatcmpl-" if chat else "cmpl-") + trace_of(request.scope).request_id
        gen = backend.generate(GenerateRequest(rid, ids, params, tenant=tenant, cache_salt=body.cache_salt))
        builder = ResponseBuilder(rid, backend.model_name, chat, body.return_token_ids)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await stream(request, gen, builder, include_usage, chat)
        return await whole(request, gen, builder, chat)

    def format_lps(lps: list[TokenLogprob] | None, chat: bool, offset: int) -> dict[str, Any] | None:
        if lps is None:
            return None
        tok = backend.tokenizer
        return chat_logprobs(tok, lps) if chat else completion_logprobs(tok, lps, offset)

    async def until_done(request: Request, task: asyncio.Future[Any],
                         gen: AsyncGenerator[GenerateDelta, None]) -> bool:
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

    async def whole(request: Request, gen: AsyncGenerator[GenerateDelta, None], builder: ResponseBuilder,
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
        return JSONResponse(builder.whole(text, last.final or "stop", format_lps(lps, chat, 0), use, ids))

    async def stream(request: Request, gen: AsyncGenerator[GenerateDelta, None], builder: ResponseBuilder,
                     include_usage: bool, chat: bool) -> Any:
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
                        yield _sse(builder.chunk(d.text, finish, format_lps(d.logprobs, chat, offset),
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

    return app


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

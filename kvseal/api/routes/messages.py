"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, over the same backend, chat template,
tool parsers, window check and tenants as /v1/chat/completions (errors in Anthropic's shape:
api/anthropic_errors.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvseal.api import respond
from kvseal.api.anthropic_format import MessagesStream, message_id, whole_message
from kvseal.api.anthropic_protocol import CountTokensRequest, MessagesRequest
from kvseal.api.routes.deps import backend_of, check_model, prompt_text
from kvseal.api.routes.generate import budget, fan_out
from kvseal.api.text import PromptText
from kvseal.api.tools.plan import ToolPlan, plan_tools
from kvseal.errors import InvalidRequest
from kvseal.router.backend import Backend
from kvseal.wire.messages import SamplingParams

router = APIRouter()


async def prompt_of(backend: Backend, texts: PromptText, body: CountTokensRequest
                    ) -> tuple[list[int], ToolPlan | None]:
    plan = plan_tools(backend.tokenizer.chat_template, body.functions(), body.choice(), body.parallel,
                      has_response_format=False)
    try:
        text = await texts.render(body.template_messages(), True, plan.template_tools if plan is not None else None)
    except ValueError as exc:
        raise InvalidRequest(f"messages: {exc}", param="messages") from exc
    if plan is not None:
        text += plan.prompt_suffix
    return await texts.encode(text, "messages", add_special_tokens=False), plan


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request) -> Any:
    backend = backend_of(request)
    check_model(backend, body.model)
    ids, plan = await prompt_of(backend, prompt_text(request), body)
    stops = tuple(body.stop_sequences or ())
    params = SamplingParams(
        max_tokens=budget(backend, ids, body.max_tokens, "max_tokens"),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        stop=stops + (plan.stops if plan is not None else ()),
        response_format=plan.response_format if plan is not None else None,
    )
    mid = message_id()
    fan = await fan_out(request, mid, ids, params, 1, None)
    splitter = plan.splitter() if plan is not None else None
    tok, model = backend.tokenizer, backend.model_name
    if body.stream:
        return await respond.stream(request, fan, MessagesStream(tok, mid, model, len(ids), splitter, stops))
    samples = await respond.gather(request, fan)
    if isinstance(samples, JSONResponse):
        return samples
    return JSONResponse(whole_message(tok, mid, model, samples[0], splitter, stops))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> Any:
    backend = backend_of(request)
    check_model(backend, body.model)
    ids, _ = await prompt_of(backend, prompt_text(request), body)
    return {"input_tokens": len(ids)}

"""/v1/chat/completions and /v1/completions: a validated body -> prompt ids and SamplingParams -> the backend.

The window check happens here, before any worker sees the request (seal 3). With n > 1 each sample is a
request of its own, started by router/fanout.py so that the samples share the prompt's cached pages.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Request

from kvseal.api import respond
from kvseal.api.openai_format import ResponseBuilder
from kvseal.api.protocol import ChatCompletionRequest, CompletionRequest, message_dicts
from kvseal.api.routes.deps import backend_of, check_model, policy_of, prompt_text, tenant_of
from kvseal.api.text import PromptText
from kvseal.api.tools.plan import Function, ToolPlan, plan_tools
from kvseal.errors import ContextLengthExceeded, InvalidRequest
from kvseal.router.backend import Backend
from kvseal.router.fanout import Deltas, Fanout
from kvseal.tenancy.limits import Lease
from kvseal.tenancy.requestlog import trace_of
from kvseal.tenancy.state import Limits
from kvseal.wire.messages import GenerateRequest, ResponseFormat, SamplingParams, response_format
from kvseal.wire.seeds import sample_seed

router = APIRouter()


def tool_plan(backend: Backend, body: ChatCompletionRequest) -> ToolPlan | None:
    functions = None if body.tools is None else [
        Function(t.function.name, t.function.description, t.function.parameters) for t in body.tools]
    fmt = body.response_format
    plan = plan_tools(backend.tokenizer.chat_template, functions, body.choice_name(), body.parallel_tool_calls,
                      has_response_format=fmt is not None and fmt.type != "text")
    if plan is not None and body.logprobs:
        raise InvalidRequest("logprobs cannot be combined with tools (tool_choice other than none)",
                             param="logprobs")
    return plan


async def chat_prompt(texts: PromptText, body: ChatCompletionRequest, plan: ToolPlan | None = None) -> list[int]:
    messages = message_dicts(body.messages)
    try:
        text = await texts.render(messages, body.add_generation_prompt,
                                  plan.template_tools if plan is not None else None)
    except ValueError as exc:
        raise InvalidRequest(f"messages: {exc}", param="messages") from exc
    if plan is not None:
        text += plan.prompt_suffix  # a forced call: the prompt opens it, the grammar writes it
    return await texts.encode(text, "messages", add_special_tokens=False)


async def completion_prompt(backend: Backend, texts: PromptText, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise InvalidRequest("only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await texts.encode(prompt, "prompt", add_special_tokens=True)
    ids = [int(t) for t in prompt]
    if any(t >= backend.tokenizer.vocab_size for t in ids):
        raise InvalidRequest("a prompt token id is outside the vocabulary", param="prompt")
    return ids


def response_format_of(body: ChatCompletionRequest | CompletionRequest) -> ResponseFormat | None:
    """The body's response_format for the engine (None: free text). Its grammar is compiled by the workers, each
    in its own compiler processes with a size and a time limit (engine/grammar_pool.py), which refuse a format
    they cannot enforce with a 400 naming it; nothing compiles here (no router thread is held by a slow schema)."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    return response_format(fmt.type, fmt.json_schema.schema_ if fmt.json_schema is not None else None)


async def counted(gen: Deltas, lease: Lease) -> Deltas:
    """The deltas of one sample, its output tokens added to what the request used (refunded to tpm at its end)."""
    try:
        async for d in gen:
            lease.used += len(d.token_ids)
            yield d
    finally:
        await gen.aclose()


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request) -> Any:
    backend = backend_of(request)
    check_model(backend, body.model)
    plan = tool_plan(backend, body)
    ids = await chat_prompt(prompt_text(request), body, plan)
    top = (body.top_logprobs or 0) if body.logprobs else None
    return await run(request, body, ids, body.max_completion_tokens or body.max_tokens, top, chat=True, plan=plan)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    backend = backend_of(request)
    check_model(backend, body.model)
    ids = await completion_prompt(backend, prompt_text(request), body)
    return await run(request, body, ids, body.max_tokens, body.logprobs, chat=False)


def budget(backend: Backend, ids: list[int], max_tokens: int | None, param: str) -> int:
    """max_tokens for a prompt (the rest of the window when absent); over the window, 400 before any worker sees
    the request (seal 3)."""
    window = backend.context_window
    if not ids:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if max_tokens is None:
        max_tokens = max(window - len(ids), 1)
    if len(ids) + max_tokens > window:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the completion). "
            f"Please reduce the length of the prompt or completion.", param=param)
    return max_tokens


async def fan_out(request: Request, rid: str, ids: list[int], params: SamplingParams, n: int,
            cache_salt: str | None, priority: int = 0) -> Fanout:
    """The n samples of one request (every API's), with the tenant's policy from the tenants file (never from the
    body) and its token rate charged before any worker sees the request."""
    backend, tenant, policy = backend_of(request), tenant_of(request), policy_of(request)
    lease: Lease | None = getattr(request.state, "rate_lease", None)  # set by tenancy/ratelimit.py
    if lease is not None:  # tpm: before any worker sees the request
        limiter: Limits = request.app.state.limits
        await limiter.charge(lease, len(ids), n * params.max_tokens)

    def start(i: int) -> Deltas:  # sample i of n: its own id and seed stream, the same prompt
        sample = msgspec.structs.replace(params, seed=sample_seed(params.seed, i))
        gen = backend.generate(GenerateRequest(
            rid if i == 0 else f"{rid}-{i}", ids, sample, tenant=tenant, cache_salt=cache_salt,
            weight=policy.weight, priority_class=policy.priority_class, kv_share=policy.kv_share, priority=priority))
        return gen if lease is None else counted(gen, lease)

    return Fanout(start, n)


async def run(request: Request, body: ChatCompletionRequest | CompletionRequest, ids: list[int],
              max_tokens: int | None, top_logprobs: int | None, chat: bool, plan: ToolPlan | None = None) -> Any:
    backend = backend_of(request)
    max_tokens = budget(backend, ids, max_tokens, "messages" if chat else "prompt")
    params = SamplingParams(
        response_format=plan.response_format if plan is not None else response_format_of(body),
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        seed=body.seed,
        stop=body.stop_list() + (plan.stops if plan is not None else ()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=top_logprobs,
        min_tokens=body.min_tokens,
        speculative=body.speculative,
    )
    rid = ("chatcmpl-" if chat else "cmpl-") + trace_of(request.scope).request_id
    fan = await fan_out(request, rid, ids, params, body.n, body.cache_salt, body.priority)
    builder = ResponseBuilder(rid, backend.model_name, chat, body.return_token_ids)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        fmt = respond.OpenAIStream(backend.tokenizer, builder, body.n, include_usage, chat, plan)
        return await respond.stream(request, fan, fmt)
    return await respond.whole(request, backend.tokenizer, fan, builder, chat, plan)

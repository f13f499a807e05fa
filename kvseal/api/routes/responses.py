"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, over the same backend, chat
template, tool parsers, window check and tenants as /v1/chat/completions. Stored responses live in the router
(tenancy/response_store.py), each under its tenant; a continued conversation is rendered in full again, and its
prompt pages come from the prefix cache under the same tenant key (seal 9)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvseal.api import respond
from kvseal.api.responses_format import (
    ResponsesStream,
    Shell,
    assistant_turn,
    logprob_entries,
    new_id,
    output_items,
    status_of,
)
from kvseal.api.responses_protocol import ResponsesRequest
from kvseal.api.routes.deps import backend_of, check_model, prompt_text, tenant_of
from kvseal.api.routes.generate import budget, fan_out
from kvseal.api.tools.calls import Text
from kvseal.api.tools.plan import plan_tools
from kvseal.errors import InvalidRequest, NotFound
from kvseal.tenancy.response_store import entry_size
from kvseal.tenancy.state import Responses
from kvseal.wire.messages import SamplingParams

router = APIRouter()


def store_of(request: Request) -> Responses:
    store: Responses = request.app.state.responses  # set by api/app.build_app
    return store


def _missing(rid: str, param: str | None = None) -> NotFound:
    return NotFound(f"Response with id '{rid}' not found.", param=param)


def settings_of(body: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as a Response echoes them."""
    c = body.tool_choice
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p, "top_logprobs": body.top_logprobs or 0,
            "tool_choice": c.model_dump() if c is not None and not isinstance(c, str) else (c or "auto"),
            "tools": [t.model_dump() for t in body.tools or []], "text": {"format": {"type": "text"}},
            "truncation": "disabled", "metadata": body.metadata or {}, "store": body.store, "user": body.user}


def fits(store: Responses, tenant: str, conversation: list[dict[str, Any]], settings: dict[str, Any]) -> None:
    """With store: true, a conversation that alone is over the tenant's stored-response budget is refused before
    any work: its answer could never be kept, and nothing else of the tenant's would survive trying."""
    need, cap = entry_size(conversation, settings), store.budget_of(tenant).bytes
    if need > cap:
        raise InvalidRequest(f"store: this conversation is already {need} bytes, more than this key's stored "
                             f"responses may hold ({cap} bytes); send store: false, or start a shorter "
                             f"conversation", param="store")


@router.post("/v1/responses")
async def create(body: ResponsesRequest, request: Request) -> Any:
    backend, tenant, store = backend_of(request), tenant_of(request), store_of(request)
    texts = prompt_text(request)
    check_model(backend, body.model)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        prev = await store.get(tenant, body.previous_response_id)  # another tenant's id is as absent as a made-up one
        if prev is None:
            raise _missing(body.previous_response_id, "previous_response_id")
        history = prev.conversation
    conversation = history + body.input_messages()
    if body.store:
        fits(store, tenant, conversation, settings_of(body))
    plan = plan_tools(backend.tokenizer.chat_template, body.functions(), body.choice(), body.parallel_tool_calls,
                      has_response_format=False)
    logprobs = body.logprobs()
    if plan is not None and logprobs is not None:  # as on /v1/chat/completions: a call's tokens are no text
        raise InvalidRequest("include: message.output_text.logprobs cannot be combined with tools (tool_choice "
                             "other than none)", param="include")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    try:
        text = await texts.render(system + conversation, True, plan.template_tools if plan is not None else None)
    except ValueError as exc:
        raise InvalidRequest(f"input: {exc}", param="input") from exc
    ids = await texts.encode(text + (plan.prompt_suffix if plan is not None else ""), "input",
                             add_special_tokens=False)
    params = SamplingParams(
        max_tokens=budget(backend, ids, body.max_output_tokens, "max_output_tokens"),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        stop=plan.stops if plan is not None else (),
        response_format=plan.response_format if plan is not None else None,
        logprobs=logprobs,
    )
    rid = new_id("resp_")
    shell = Shell(rid, backend.model_name, settings_of(body))

    async def done(out: dict[str, Any], items: list[dict[str, Any]]) -> None:
        if body.store:
            await store.put(tenant, rid, [*conversation, assistant_turn(items)], out)

    fan = await fan_out(request, rid, ids, params, 1, None)
    if body.stream:
        return await respond.stream(request, fan, ResponsesStream(shell, plan.splitter() if plan else None, done,
                                                                backend.tokenizer if logprobs is not None else None))
    samples = await respond.gather(request, fan)
    if isinstance(samples, JSONResponse):
        return samples
    s = samples[0]
    assert s.final is not None
    if plan is not None:
        splitter = plan.splitter()
        items = output_items(splitter.feed(s.text) + splitter.finish())
    else:
        items = output_items([Text(s.text)])
        if logprobs is not None and items:
            items[0]["content"][0]["logprobs"] = logprob_entries(backend.tokenizer, s.lps or [])
    status = status_of(s.final)
    for item in items:
        if item["type"] == "message":
            item["status"] = status  # a message cut by max_output_tokens is incomplete
    out = shell.body(status, items, s.final)
    await done(out, items)
    return JSONResponse(out)


@router.get("/v1/responses/{rid}")
async def retrieve(rid: str, request: Request) -> Any:
    found = await store_of(request).get(tenant_of(request), rid)
    if found is None:
        raise _missing(rid)
    return found.body


@router.delete("/v1/responses/{rid}")
async def delete(rid: str, request: Request) -> Any:
    if not await store_of(request).delete(tenant_of(request), rid):
        raise _missing(rid)
    return {"id": rid, "object": "response", "deleted": True}

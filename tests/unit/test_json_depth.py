"""JSON inside a request is read at most MAX_JSON_DEPTH levels deep (api/json_depth.py): a call's arguments
text, a tool's schema, response_format's schema, a tool_use input; deeper is a 400 naming the field and the limit,
never a RecursionError (a 500) in the template or the schema that walks it later."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from kvseal.api.anthropic_protocol import MessagesRequest
from kvseal.api.http_errors import validation_error
from kvseal.api.json_depth import MAX_JSON_DEPTH, TooDeep, loads, raw_decode, too_deep
from kvseal.api.protocol import ChatCompletionRequest, message_dicts
from kvseal.api.responses_protocol import ResponsesRequest
from kvseal.errors import InvalidRequest


def arrays(levels: int) -> str:
    return "[" * levels + "]" * levels


def schema(levels: int) -> dict[str, Any]:
    """A JSON object `levels` deep, itself counted."""
    return {"type": "object", "x": json.loads(arrays(levels - 1))}


def test_depth_counts_arrays_and_objects_with_the_outermost() -> None:
    assert not too_deep(1) and not too_deep("[[[") and not too_deep([]) and not too_deep({})
    assert not too_deep(json.loads(arrays(MAX_JSON_DEPTH))) and too_deep(json.loads(arrays(MAX_JSON_DEPTH + 1)))
    assert [too_deep({"a": [{"b": 1}]}, limit) for limit in (2, 3)] == [True, False]
    wide = [[1] * 3, {"a": [[]]}, 2]  # the deepest branch counts, not the first
    assert too_deep(wide, 3) and not too_deep(wide, 4)


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 5000])
def test_parsing_past_the_limit_is_a_value_error_never_a_recursion_error(levels: int) -> None:
    with pytest.raises(TooDeep):
        loads(arrays(levels))
    with pytest.raises(TooDeep):
        raw_decode("  " + arrays(levels), 2)
    assert loads(arrays(MAX_JSON_DEPTH)) is not None and raw_decode(arrays(3) + " x", 0)[1] == 6
    assert issubclass(TooDeep, ValueError)  # callers that read "not JSON" read "too deep" the same way


def refused(model: type[BaseModel], body: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return validation_error(e.value.errors())  # what the HTTP layer answers (api/http_errors.py)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def fn(s: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": s}}


@pytest.mark.parametrize(("model", "body", "param"), [
    (ChatCompletionRequest, lambda s: {**CHAT, "tools": [fn(s)]}, "tools.0.function.parameters"),
    (ChatCompletionRequest, lambda s: {**CHAT, "response_format": {"type": "json_schema",
                                                                   "json_schema": {"schema": s}}},
     "response_format.json_schema.schema"),
    (MessagesRequest, lambda s: {**CHAT, "max_tokens": 5, "tools": [{"name": "f", "input_schema": s}]},
     "tools.0.input_schema"),
    (MessagesRequest, lambda s: {**CHAT, "max_tokens": 5, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": s}]}]},
     "messages.0.content.0.tool_use.input"),
    (ResponsesRequest, lambda s: {"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f",
                                                                        "parameters": s}]},
     "tools.0.parameters"),
])
def test_a_schema_or_input_past_the_limit_is_a_400_naming_it(model: type[BaseModel], body: Any, param: str) -> None:
    model.model_validate(body(schema(MAX_JSON_DEPTH)))  # at the limit: accepted
    err = refused(model, body(schema(MAX_JSON_DEPTH + 1)))
    assert (err.status, err.param) == (400, param) and f"{MAX_JSON_DEPTH} levels" in err.message


def call_of(arguments: str) -> dict[str, Any]:
    return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 5000])
def test_chat_arguments_past_the_limit_are_a_400_naming_them(levels: int) -> None:
    body = ChatCompletionRequest.model_validate({**CHAT, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [call_of("{}"), call_of('{"a": ' + arrays(levels - 1) + "}")]}]})
    with pytest.raises(InvalidRequest) as e:
        message_dicts(body.messages)
    assert e.value.param == "messages.1.tool_calls.1.function.arguments"
    assert f"{MAX_JSON_DEPTH} levels" in e.value.message and e.value.message.startswith(e.value.param)


def test_chat_arguments_at_the_limit_or_not_json_render_as_before() -> None:
    deep = '{"a": ' + arrays(MAX_JSON_DEPTH - 1) + "}"
    body = ChatCompletionRequest.model_validate({**CHAT, "messages": [
        {"role": "assistant", "tool_calls": [call_of(deep), call_of("not json {")]}]})
    args = [c["function"]["arguments"] for c in message_dicts(body.messages)[0]["tool_calls"]]
    assert args == [json.loads(deep), "not json {"]


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 5000])
def test_responses_function_call_arguments_past_the_limit_are_a_400_naming_them(levels: int) -> None:
    body = ResponsesRequest.model_validate({"model": "m", "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arrays(levels)}]})
    with pytest.raises(InvalidRequest) as e:
        body.input_messages()
    assert e.value.param == "input.1.arguments" and f"{MAX_JSON_DEPTH} levels" in e.value.message

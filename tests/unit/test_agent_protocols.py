"""Anthropic and Responses bodies -> the chat-template messages the model's template renders (tool_use and
function_call become an assistant's tool_calls, tool_result and function_call_output become tool messages), and
OpenAI-shaped error bodies -> Anthropic's."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvseal.api.anthropic_errors import from_openai
from kvseal.api.anthropic_protocol import MessagesRequest
from kvseal.api.responses_protocol import ResponsesRequest


def test_anthropic_blocks_become_template_messages() -> None:
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "17C"},
                                         {"type": "text", "text": "Thanks"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                          "content": [{"type": "text", "text": "timeout"}]}]}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert body.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "17C"},
        {"role": "user", "content": "Thanks"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"}]
    assert (body.choice(), body.parallel) == ("required", False)


def test_responses_items_become_template_messages() -> None:
    body = ResponsesRequest.model_validate({"model": "m", "input": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris and Rome?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{\"city\": \"Rome\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "17C"},
        {"type": "function_call_output", "call_id": "c2", "output": "21C"}],
        "tool_choice": {"type": "function", "name": "get_weather"}})
    msgs = body.input_messages()
    assert msgs[0] == {"role": "system", "content": "Be brief."}
    assert msgs[2]["role"] == "assistant" and [c["function"]["arguments"] for c in msgs[2]["tool_calls"]] == [
        {"city": "Paris"}, {"city": "Rome"}]  # one assistant turn, arguments as objects for the template
    assert msgs[3:] == [{"role": "tool", "tool_call_id": "c1", "content": "17C"},
                        {"role": "tool", "tool_call_id": "c2", "content": "21C"}]
    assert body.choice() == "get_weather"
    assert ResponsesRequest.model_validate({"model": "m", "input": "hi"}).input_messages() == [
        {"role": "user", "content": "hi"}]


def test_openai_error_bodies_become_anthropic_ones() -> None:
    body = json.dumps({"error": {"message": "bad", "type": "invalid_request_error", "param": "x", "code": None}})
    assert json.loads(from_openai(400, body.encode())) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert json.loads(from_openai(401, body.encode()))["error"]["type"] == "authentication_error"
    assert json.loads(from_openai(503, body.encode()))["error"]["type"] == "overloaded_error"
    assert json.loads(from_openai(500, b"oops")) == {"type": "error", "error": {"type": "api_error", "message": "oops"}}


def test_responses_include_asks_for_logprobs_or_nothing() -> None:
    """The Agents SDK's `include: []` and `tools: []` ask for nothing; include's logprobs turn the engine's on with
    top_logprobs alternatives; any other include value is refused, naming it."""
    def body(**kw: object) -> ResponsesRequest:
        return ResponsesRequest.model_validate({"model": "m", "input": "hi", **kw})

    assert body(include=[], tools=[]).logprobs() is None and body(tools=[]).functions() is None
    assert body(top_logprobs=3).logprobs() is None  # alternatives without include: none, as OpenAI's
    assert body(include=["message.output_text.logprobs"]).logprobs() == 0
    assert body(include=["message.output_text.logprobs"], top_logprobs=3).logprobs() == 3
    with pytest.raises(ValidationError, match="'file_search_call.results' cannot be included"):
        body(include=["message.output_text.logprobs", "file_search_call.results"])

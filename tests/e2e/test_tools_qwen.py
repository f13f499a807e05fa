"""OpenAI tool calling on Qwen2.5-Coder-0.5B-Instruct (its own chat template, Hermes `<tool_call>` family), with the
official openai client, unified and disaggregated: a weather tool called with the right arguments, whole and
through the client's stream helper; a two-turn loop whose answer uses the tool's result; `required` and a named
function give schema-valid calls 20/20 (even for prompts that have nothing to do with the tools); `none` never
gives a call; a forced call cut by max_tokens is no call and no text, whole and streamed; 16 stops beside one call
at a time; JSON nested past the limit is a 400 naming it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from tests.helpers.procs import Server
from tests.helpers.qwen_server import KEYS

pytestmark = pytest.mark.e2e
MODEL = "qwen2.5-coder-0.5b-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in an IANA time zone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"],
                   "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]
# prompts for the constrained choices: about the tools, and about nothing of the kind
PROMPTS = ["What's the weather in Oslo?", "Will it be hot in Cairo this week?", "Is it snowing in Montreal?",
           "What time is it in Tokyo?", "Tell me the time in New York.", "Weather for Lima, in fahrenheit please.",
           "Write a haiku about the sea.", "What is 17 times 3?", "Explain recursion in one sentence.",
           "Translate 'good morning' into French.", "def fib(n):", "Name three prime numbers.",
           "Do I need an umbrella in London tomorrow?", "Hello!", "What is the capital of Peru?",
           "Summarize the plot of Hamlet.", "It's 3am in Sydney, right?", "Forecast for Nairobi for 5 days.",
           "List two sorting algorithms.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def client(qwen_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=qwen_server.url + "/v1", api_key=KEYS["tools"], max_retries=0, timeout=600)


def chat(client: openai.OpenAI, messages: list[Any], **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **{"max_tokens": 48, **kw})


def test_a_weather_tool_is_called_with_the_right_arguments(client: openai.OpenAI) -> None:
    r = chat(client, ASK, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] == "Paris"


def test_the_stream_helper_assembles_the_streamed_call(client: openai.OpenAI) -> None:
    chunks = 0
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                        max_tokens=48) as stream:
        for event in stream:
            chunks += event.type == "chunk"
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content and chunks >= 3
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"


def test_a_two_turn_tool_loop_answers_with_the_tools_result(client: openai.OpenAI) -> None:
    first = chat(client, ASK, tools=TOOLS).choices[0].message
    (call,) = first.tool_calls
    # the 0.5B repeats its call unless the result says what to do next (tool results that instruct are common)
    result = "Paris: 17°C, light rain.\nNow write the answer for the user in plain text, do not call the tool again."
    history = [*ASK, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = chat(client, history, tools=TOOLS).choices[0]
    assert second.finish_reason == "stop" and not second.message.tool_calls
    assert "17°C" in second.message.content and "rain" in second.message.content


def calls_of(client: openai.OpenAI, tool_choice: Any, max_tokens: int = 64) -> list[Any]:
    def one(prompt: str) -> Any:
        return chat(client, [{"role": "user", "content": prompt}], tools=TOOLS, tool_choice=tool_choice,
                    max_tokens=max_tokens).choices[0]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # one batch on the workers
        return list(pool.map(one, PROMPTS))


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_required_and_named_calls_always_follow_the_schema(client: openai.OpenAI, tool_choice: Any) -> None:
    choices = calls_of(client, tool_choice)
    for c in choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
        call = c.message.tool_calls[0]
        if isinstance(tool_choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len(choices) == 20


def test_none_never_calls(client: openai.OpenAI) -> None:
    assert chat(client, ASK, tools=TOOLS).choices[0].message.tool_calls  # the same prompt calls under auto
    for c in calls_of(client, "none", max_tokens=24):  # a call would open the answer
        assert not c.message.tool_calls and c.finish_reason in ("stop", "length") and c.message.content


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "strict_mode": True}}]},
     "tools.0.function.strict_mode"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "logprobs": True}, "logprobs"),
    ({"tools": []}, "tools"),
])
def test_what_tools_cannot_honour_is_a_400_naming_it(client: openai.OpenAI, extra: dict[str, Any],
                                                     param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body=extra)
    assert e.value.status_code == 400 and e.value.param == param


def test_a_forced_call_cut_by_max_tokens_is_no_call_and_no_text_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = chat(client, ASK, tools=TOOLS, tool_choice="required", max_tokens=3).choices[0]
    assert (whole.finish_reason, whole.message.tool_calls, whole.message.content) == ("length", None, "")
    text, calls, finish = "", 0, None
    for chunk in chat(client, ASK, tools=TOOLS, tool_choice="required", max_tokens=3, stream=True):
        delta = chunk.choices[0].delta
        text, calls = text + (delta.content or ""), calls + len(delta.tool_calls or [])
        finish = chunk.choices[0].finish_reason or finish
    assert (finish, calls, text) == ("length", 0, "")  # the same answer, without the prompt's `<tool_call>` markup


def test_sixteen_stops_and_one_call_at_a_time(client: openai.OpenAI) -> None:
    """The stop a single-call plan adds is kvseal's own: it neither counts against the client's 16 nor shows."""
    stops = [f"zebra{i}" for i in range(16)]
    r = chat(client, ASK, tools=TOOLS, parallel_tool_calls=False, stop=stops).choices[0]
    assert r.finish_reason == "tool_calls" and [c.function.name for c in r.message.tool_calls] == ["get_weather"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, ASK, tools=TOOLS, parallel_tool_calls=False, stop=[*stops, "zebra16"])
    assert e.value.param == "stop" and "</tool_call>" not in e.value.message and "16" in e.value.message


def nested(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize(("extra", "param"), [
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": ' + nested(5000) + "}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "17°C"}]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "x": json.loads(nested(128))}}}]},
     "tools.0.function.parameters"),
])
def test_json_nested_past_the_limit_is_a_400_naming_it(client: openai.OpenAI, extra: dict[str, Any],
                                                       param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, ASK, tools=TOOLS, max_tokens=2, extra_body=extra)
    assert e.value.status_code == 400 and e.value.param == param and "128 levels" in e.value.message

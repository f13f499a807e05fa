"""OpenAI's Responses API on Qwen2.5-Coder-0.5B-Instruct with the official openai client, unified and
disaggregated: string input with instructions, a weather tool whole and through the client's stream helper (text
too), a two-turn tool loop continued with previous_response_id whose answer uses the tool's result (its prompt pages
from the prefix cache, under its own tenant only), a required call valid against its schema, stored responses that
are their tenant's alone (another tenant's id: 404), unknown fields refused by name, a required call cut by
max_output_tokens that leaves no output whole and streamed, and arguments nested past the limit a 400."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema
import openai
import pytest

from tests.helpers.procs import Server
from tests.helpers.qwen_server import KEYS as QWEN_KEYS

pytestmark = pytest.mark.e2e
MODEL = "qwen2.5-coder-0.5b-instruct"
KEYS = {"alice": QWEN_KEYS["r-alice"], "bob": QWEN_KEYS["r-bob"]}  # this module's tenants on the shared server
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"type": "string",
                                                                    "enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
ASK = "What's the weather like in Paris today?"
RESULT = "Paris: 17°C, light rain.\nNow write the answer for the user in plain text, do not call the tool again."


@dataclass
class Fleet:
    alice: openai.OpenAI
    bob: openai.OpenAI


@pytest.fixture(scope="module")
def fleet(qwen_server: Server) -> Fleet:
    return Fleet(*(openai.OpenAI(base_url=qwen_server.url + "/v1", api_key=KEYS[t], max_retries=0, timeout=600)
                   for t in ("alice", "bob")))


def create(c: openai.OpenAI, **kw: Any) -> Any:
    return c.responses.create(model=MODEL, **{"temperature": 0, "max_output_tokens": 48, **kw})


def test_text_whole_and_streamed(fleet: Fleet) -> None:
    r = create(fleet.alice, input="Name a color.", instructions="Be brief.")
    assert r.status == "completed" and r.output_text and r.output[0].type == "message"
    assert r.id.startswith("resp_") and r.instructions == "Be brief."
    with fleet.alice.responses.stream(model=MODEL, input="Name a color.", instructions="Be brief.", temperature=0,
                                      max_output_tokens=48) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == r.output_text
    short = create(fleet.alice, input="Name a color.", instructions="Be brief.", max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_a_weather_tool_is_called_whole_and_streamed(fleet: Fleet) -> None:
    r = create(fleet.alice, input=ASK, tools=[WEATHER])
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] == "Paris"
    with fleet.alice.responses.stream(model=MODEL, input=ASK, tools=[WEATHER], temperature=0,
                                      max_output_tokens=48) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    (streamed,) = final.output
    assert streamed.name == "get_weather" and streamed.arguments == call.arguments


def test_a_continued_tool_loop_uses_the_result_and_stays_with_its_tenant(fleet: Fleet) -> None:
    first = create(fleet.alice, input=ASK, tools=[WEATHER])
    (call,) = first.output
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    second = create(fleet.alice, input=answer, previous_response_id=first.id, tools=[WEATHER])
    assert second.status == "completed" and "17°C" in second.output_text
    assert [o.type for o in second.output] == ["message"] and second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0  # the conversation so far, from alice's cache
    assert fleet.alice.responses.retrieve(second.id).output_text == second.output_text
    # another tenant: the id does not exist for them, and they have no hit in alice's cache
    with pytest.raises(openai.NotFoundError) as e:
        create(fleet.bob, input=answer, previous_response_id=first.id, tools=[WEATHER])
    assert e.value.status_code == 404 and e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        fleet.bob.responses.retrieve(first.id)
    bob = create(fleet.bob, input=ASK, tools=[WEATHER], max_output_tokens=1)
    assert bob.usage.input_tokens == first.usage.input_tokens and bob.usage.input_tokens_details.cached_tokens == 0
    fleet.alice.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        fleet.alice.responses.retrieve(second.id)


def test_a_required_call_follows_the_schema(fleet: Fleet) -> None:
    for prompt in ["Write a haiku about the sea.", "What is 17 times 3?"]:
        r = create(fleet.alice, input=prompt, tools=[WEATHER], tool_choice="required")
        (call,) = r.output
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


@pytest.mark.parametrize(("extra", "param"), [
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"tools": [{**WEATHER, "type": "web_search"}]}, "tools.0.type"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format.type"),
])
def test_unknown_fields_are_a_400_naming_them(fleet: Fleet, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        create(fleet.alice, input="hi", max_output_tokens=2, extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_a_required_call_cut_by_max_output_tokens_is_no_output_whole_and_streamed(fleet: Fleet) -> None:
    r = create(fleet.alice, input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=3)
    assert (r.status, r.incomplete_details.reason, r.output) == ("incomplete", "max_output_tokens", [])
    with fleet.alice.responses.stream(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required",
                                      temperature=0, max_output_tokens=3) as stream:
        events = list(stream)  # (the helper's get_final_response() wants a response.completed)
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.incomplete"]
    final = events[-1].response
    assert (final.status, final.output) == ("incomplete", [])  # never the prompt's `<tool_call>` as output_text


def test_function_call_arguments_nested_past_the_limit_are_a_400_naming_them(fleet: Fleet) -> None:
    deep = '{"city": ' + "[" * 5000 + "]" * 5000 + "}"
    with pytest.raises(openai.BadRequestError) as e:
        create(fleet.alice, tools=[WEATHER], input=[
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": deep},
            {"type": "function_call_output", "call_id": "c1", "output": RESULT}])
    assert e.value.status_code == 400 and e.value.body["param"] == "input.0.arguments"
    assert "128 levels" in e.value.body["message"]

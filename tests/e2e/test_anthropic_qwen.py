"""Anthropic's Messages API on Qwen2.5-Coder-0.5B-Instruct with the official anthropic client, unified and
disaggregated: system and multi-turn text, stop sequences and max_tokens with their stop reasons, a weather tool
whole and through the client's stream helper, a two-turn tool_use/tool_result loop, a named tool always valid,
count_tokens equal to what a request counts, keys from x-api-key mapped to the same tenants as a bearer key,
every error in Anthropic's shape, a forced tool cut by max_tokens that leaves no block whole and streamed, 16
stop_sequences beside disable_parallel_tool_use, and a tool_use input nested past the limit a 400."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.helpers.procs import Server
from tests.helpers.qwen_server import KEYS as QWEN_KEYS

pytestmark = pytest.mark.e2e
MODEL = "qwen2.5-coder-0.5b-instruct"
KEYS = {"alice": QWEN_KEYS["m-alice"], "bob": QWEN_KEYS["m-bob"]}  # this module's tenants on the shared server
GREEDY = {"temperature": 0}  # this client no longer sends sampling fields by name: they go as extra_body
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                             "unit": {"type": "string",
                                                                      "enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "The current time in an IANA time zone",
        "input_schema": {"type": "object", "properties": {"timezone": {"type": "string"}},
                         "required": ["timezone"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]


@dataclass
class Fleet:
    server: Server
    alice: anthropic.Anthropic


@pytest.fixture(scope="module")
def fleet(qwen_server: Server) -> Fleet:
    return Fleet(qwen_server, anthropic.Anthropic(base_url=qwen_server.url, api_key=KEYS["alice"], max_retries=0,
                                                   timeout=600))


def create(c: anthropic.Anthropic, messages: list[Any], **kw: Any) -> Any:
    return c.messages.create(model=MODEL, messages=messages, **{"max_tokens": 48, "extra_body": GREEDY, **kw})


def test_system_multi_turn_stops_and_max_tokens(fleet: Fleet) -> None:
    c = fleet.alice
    turns = [{"role": "user", "content": "Count from 1 to 10, separated by commas."},
             {"role": "assistant", "content": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10"},
             {"role": "user", "content": [{"type": "text", "text": "Again, please."}]}]
    full = create(c, turns, system="You are a counting assistant.")
    assert full.stop_reason == "end_turn" and full.stop_sequence is None and "1, 2, 3" in full.content[0].text
    cut = create(c, turns, system=[{"type": "text", "text": "You are a counting assistant."}],
                 stop_sequences=["4", "zebra"])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", "4") and cut.content[0].text.endswith("3, ")
    short = create(c, turns, system="You are a counting assistant.", max_tokens=3)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    with c.messages.stream(model=MODEL, messages=turns, system="You are a counting assistant.", max_tokens=48,
                           extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == full.content[0].text and final.stop_reason == "end_turn"
    counted = c.messages.count_tokens(model=MODEL, messages=turns, system="You are a counting assistant.")
    assert counted.input_tokens == full.usage.input_tokens + full.usage.cache_read_input_tokens


def test_a_weather_tool_is_used_whole_and_streamed(fleet: Fleet) -> None:
    r = create(fleet.alice, ASK, tools=[WEATHER, TIME])
    assert r.stop_reason == "tool_use"
    (use,) = r.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input["city"] == "Paris"
    assert use.id.startswith("toolu_")
    with fleet.alice.messages.stream(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=48,
                                     extra_body=GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_start" in kinds
    assert final.stop_reason == "tool_use" and final.content[0].input == use.input


def test_a_two_turn_tool_loop_answers_with_the_tools_result(fleet: Fleet) -> None:
    first = create(fleet.alice, ASK, tools=[WEATHER])
    (use,) = first.content
    result = "Paris: 17°C, light rain.\nNow write the answer for the user in plain text, do not call the tool again."
    history = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}]
    second = create(fleet.alice, history, tools=[WEATHER])
    assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["text"]
    assert "17°C" in second.content[0].text


def test_a_named_tool_is_always_valid_and_none_never_calls(fleet: Fleet) -> None:
    prompts = ["Write a haiku about the sea.", "What time is it in Tokyo?", "def fib(n):", "Hello!", "Why?"]

    def one(prompt: str, choice: dict[str, Any]) -> Any:
        return create(fleet.alice, [{"role": "user", "content": prompt}], tools=[WEATHER, TIME], tool_choice=choice,
                      max_tokens=24 if choice["type"] == "none" else 48)  # a call would open the answer

    with ThreadPoolExecutor(len(prompts)) as pool:
        named = list(pool.map(lambda p: one(p, {"type": "tool", "name": "get_time"}), prompts))
        none = list(pool.map(lambda p: one(p, {"type": "none"}), [ASK[0]["content"], *prompts]))
    for r in named:
        assert r.stop_reason == "tool_use" and [b.name for b in r.content] == ["get_time"]
        jsonschema.validate(r.content[0].input, TIME["input_schema"])
    assert all(r.stop_reason != "tool_use" and all(b.type == "text" for b in r.content) for r in none)


def test_keys_from_x_api_key_are_the_same_tenants(fleet: Fleet) -> None:
    def completed(key: str) -> int:
        info = httpx.get(fleet.server.url + "/info", headers={"authorization": f"Bearer {key}"}, timeout=30).json()
        return int(info["requests"]["completed"])

    before = completed(KEYS["alice"]), completed(KEYS["bob"])
    create(fleet.alice, ASK, max_tokens=2)
    assert (completed(KEYS["alice"]), completed(KEYS["bob"])) == (before[0] + 1, before[1])
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=fleet.server.url, api_key="sk-nobody", max_retries=0).messages.create(
            model=MODEL, messages=ASK, max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(("extra", "named"), [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"temperature": 1.5}, "temperature"),
    ({"tools": [{**WEATHER, "strict": True}]}, "tools.0.strict"),
    ({"tool_choice": {"type": "tool", "name": "rm"}, "tools": [WEATHER]}, "tool_choice"),
])
def test_errors_are_anthropic_shaped_and_name_the_field(fleet: Fleet, extra: dict[str, Any], named: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        fleet.alice.messages.create(model=MODEL, messages=ASK, max_tokens=2, extra_body=extra)
    body = e.value.body
    assert e.value.status_code == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and named in body["error"]["message"]
    r = httpx.post(fleet.server.url + "/v1/messages", headers={"x-api-key": KEYS["bob"]}, timeout=30,
                   json={"model": "claude-x", "max_tokens": 2, "messages": ASK})
    assert r.status_code == 404 and json.loads(r.text)["error"]["type"] == "not_found_error"


def test_any_tool_cut_by_max_tokens_is_no_block_whole_and_streamed(fleet: Fleet) -> None:
    r = create(fleet.alice, ASK, tools=[WEATHER], tool_choice={"type": "any"}, max_tokens=3)
    assert (r.stop_reason, r.content) == ("max_tokens", [])
    with fleet.alice.messages.stream(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"},
                                     max_tokens=3, extra_body=GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "content_block_start" not in kinds  # never the prompt's `<tool_call>` as a text block
    assert (final.stop_reason, final.content) == ("max_tokens", [])


def test_sixteen_stop_sequences_and_one_tool_use_at_a_time(fleet: Fleet) -> None:
    r = create(fleet.alice, ASK, tools=[WEATHER], stop_sequences=[f"zebra{i}" for i in range(16)],
               tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert r.stop_reason == "tool_use" and [b.name for b in r.content] == ["get_weather"]


def test_a_tool_use_input_nested_past_the_limit_is_a_400_naming_it(fleet: Fleet) -> None:
    deep: Any = "x"
    for _ in range(129):  # one level past the limit
        deep = {"a": deep}
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": deep}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "17°C"}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        create(fleet.alice, history, tools=[WEATHER], max_tokens=2)
    message = e.value.body["error"]["message"]
    assert e.value.status_code == 400 and "messages.1.content.0.tool_use.input" in message and "128 levels" in message

"""Tool-call splitters (api/tools/): the same events whole or streamed in any cut, a broken call stays text (a
forced one cut short is nothing), and text that may start a call is held back until it is decided."""

from __future__ import annotations

import json

import pytest

from kvseal.api.json_depth import MAX_JSON_DEPTH
from kvseal.api.tools.calls import Call, Event, Text
from kvseal.api.tools.families import family_of
from kvseal.api.tools.hermes import Hermes
from kvseal.api.tools.llama3 import Llama3
from kvseal.api.tools.output import StreamCalls, split_whole
from kvseal.api.tools.plan import Function, plan_tools
from kvseal.engine.params import check_sampling
from kvseal.errors import InvalidRequest
from kvseal.wire.messages import MAX_ADDED_STOPS, MAX_STOPS, SamplingParams

NAMES = frozenset({"get_weather", "get_time"})
QWEN_TEMPLATE = "{% if tools %}<tools>{% endif %}<tool_call>\n{\"name\": ...}\n</tool_call>"
LLAMA_TEMPLATE = ('<|start_header_id|>{% if tools %}{"name": function name, "parameters": dictionary}{% endif %}'
                  '<|eot_id|>')
WEATHER = Function("get_weather", "Weather of a city", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


def cuts(splitter_of: object, text: str, size: int) -> list[Event]:
    sp = splitter_of()  # type: ignore[operator]
    out: list[Event] = []
    for k in range(0, len(text), size):
        out += sp.feed(text[k:k + size])
    return merged(out + sp.finish())


def merged(events: list[Event]) -> list[Event]:
    out: list[Event] = []
    for e in events:
        if isinstance(e, Text) and out and isinstance(out[-1], Text):
            out[-1] = Text(out[-1].text + e.text)
        else:
            out.append(e)
    return out


HERMES_CASES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [Call("get_weather", '{"city": "Paris"}')]),
    (('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_time", "arguments": {}}\n</tool_call>'),
     [Call("get_weather", '{"city": "Paris"}'), Call("get_time", "{}")]),
    ("It is sunny, x < y and <tool no.", [Text("It is sunny, x < y and <tool no.")]),
    # arguments that do not parse, or an unknown function: the text as it was, never a broken call
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
     [Text('<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>')]),
    ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
     [Text('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>')]),
    # a model that stops right after the JSON (EOS, or the single-call stop string)
    ('<tool_call>\n{"name": "get_time", "arguments": {}}', [Call("get_time", "{}")]),
    ('<tool_call>\n{"name": "get_time", "argu', [Text('<tool_call>\n{"name": "get_time", "argu')]),
    ("Let me check.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
     [Text("Let me check."), Call("get_time", "{}")]),
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n\nDone, see above.\n',
     [Call("get_time", "{}"), Text("Done, see above.")]),
    ("two words \n", [Text("two words \n")]),
    # the bare JSON small models write: calls when all of it is calls, else text
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', [Call("get_weather", '{"city": "Paris"}')]),
    ('\n{"name": "get_time", "arguments": {}}\n{"name": "get_time", "arguments": {}}',
     [Call("get_time", "{}"), Call("get_time", "{}")]),
    ('{"name": "get_time", "arguments": {}} is what I would call', [
        Text('{"name": "get_time", "arguments": {}} is what I would call')]),
    ('```json\n{\n  "name": "get_time",\n  "arguments": {}\n}\n```', [Call("get_time", "{}")]),
    ("```python\nprint(1)\n```", [Text("```python\nprint(1)\n```")]),
    ("```json\n[1, 2]\n```", [Text("```json\n[1, 2]\n```")]),
    ('{"a": 1} then <tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     [Text('{"a": 1} then'), Call("get_time", "{}")]),
]


@pytest.mark.parametrize(("text", "want"), HERMES_CASES)
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_hermes_gives_the_same_events_in_any_cut(text: str, want: list[Event], size: int) -> None:
    assert cuts(lambda: Hermes().splitter(NAMES, forced=False), text, size) == want


def test_hermes_holds_back_what_may_open_a_call_and_no_more() -> None:
    sp = Hermes().splitter(NAMES, forced=False)
    assert sp.feed("Sure <tool") == [Text("Sure")]  # its trailing blank waits for what follows, too
    assert sp.feed("s are fine") == [Text(" <tools are fine")]
    assert sp.feed(" x <tool_c") == [Text(" x")]
    assert sp.feed('all>{"name": "get_time", "arguments": {}}') == []
    assert sp.finish() == [Call("get_time", "{}")]


def test_a_fenced_answer_streams_once_its_language_is_not_json() -> None:
    sp = Hermes().splitter(NAMES, forced=False)
    assert sp.feed("```") == [] and sp.feed("js") == [] and sp.feed("on\n") == []
    sp = Hermes().splitter(NAMES, forced=False)
    assert sp.feed("```py") == [Text("```py")]


def test_a_forced_hermes_output_starts_inside_the_call() -> None:
    sp = Hermes().splitter(NAMES, forced=True)
    assert sp.feed('{"name": "get_weather", "arguments": {"city": "Oslo"}}') == []
    assert sp.finish() == [Call("get_weather", '{"city": "Oslo"}')]


@pytest.mark.parametrize(("text", "want"), [
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', [Call("get_weather", '{"city": "Rome"}')]),
    ('<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "a;b"}}',
     [Call("get_time", "{}"), Call("get_weather", '{"city": "a;b"}')]),
    ("The weather is fine.", [Text("The weather is fine.")]),
    ('{"name": "get_weather", "parameters": {"city": ', [Text('{"name": "get_weather", "parameters": {"city": ')]),
    ('{"a": 1}', [Text('{"a": 1}')]),
])
@pytest.mark.parametrize("size", [1, 5, 1000])
def test_llama3_json_calls(text: str, want: list[Event], size: int) -> None:
    assert cuts(lambda: Llama3().splitter(NAMES, forced=False), text, size) == want


def test_families_come_from_the_template() -> None:
    assert isinstance(family_of(QWEN_TEMPLATE), Hermes)
    assert isinstance(family_of(LLAMA_TEMPLATE), Llama3)
    assert family_of("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}") is None
    with pytest.raises(InvalidRequest) as e:
        plan_tools("{{ messages }}", [WEATHER], None, True, False)
    assert e.value.param == "tools" and "no tool-call format" in e.value.message


def test_plans_for_each_tool_choice() -> None:
    assert plan_tools(QWEN_TEMPLATE, [WEATHER], "none", True, False) is None
    auto = plan_tools(QWEN_TEMPLATE, [WEATHER], None, True, False)
    assert auto is not None and not auto.forced and auto.response_format is None and auto.prompt_suffix == ""
    assert plan_tools(QWEN_TEMPLATE, [WEATHER], "auto", False, False).stops == ("</tool_call>",)  # type: ignore[union-attr]
    req = plan_tools(QWEN_TEMPLATE, [WEATHER, Function("get_time", None, None)], "required", True, False)
    assert req is not None and req.forced and req.prompt_suffix == "<tool_call>\n"
    assert req.response_format is not None and req.response_format.schema is not None
    schema = json.loads(req.response_format.schema)
    assert [s["properties"]["name"] for s in schema["anyOf"]] == [{"const": "get_weather"}, {"const": "get_time"}]
    assert schema["anyOf"][1]["properties"]["arguments"] == {"type": "object", "properties": {}}
    named = plan_tools(QWEN_TEMPLATE, [WEATHER, Function("get_time", None, None)], "get_weather", True, False)
    assert named is not None and named.names == {"get_weather"}
    assert json.loads(named.response_format.schema)["properties"]["arguments"] == WEATHER.parameters  # type: ignore[union-attr, arg-type]


@pytest.mark.parametrize(("functions", "choice", "fmt", "param"), [
    (None, "auto", False, "tool_choice"),
    ([], None, False, "tools"),
    ([WEATHER, WEATHER], None, False, "tools"),
    ([WEATHER], "get_time", False, "tool_choice"),
    ([WEATHER], "required", True, "response_format"),
])
def test_plans_refuse_what_they_cannot_honour(functions: list[Function] | None, choice: str, fmt: bool,
                                              param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        plan_tools(QWEN_TEMPLATE, functions, choice, True, fmt)
    assert e.value.param == param


def test_no_parallel_calls_returns_the_first_only() -> None:
    plan = plan_tools(LLAMA_TEMPLATE, [WEATHER, Function("get_time", None, None)], "auto", False, False)
    assert plan is not None
    text, calls = split_whole(plan.splitter(), '{"name": "get_time", "parameters": {}}; '
                                                '{"name": "get_weather", "parameters": {"city": "x"}}')
    assert (text, calls) == ("", [Call("get_time", "{}")])


def test_streamed_calls_name_once_then_fragments_that_join_to_the_arguments() -> None:
    args = {"city": "Paris " * 30}
    sc = StreamCalls(Hermes().splitter(NAMES, forced=False))
    body = f'Hi <tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(args)}}}\n</tool_call>'
    deltas = [d for k in range(0, len(body), 4) for d in sc.deltas(body[k:k + 4], False)] + sc.deltas("", True)
    assert "".join(t for t, _ in deltas if t) == "Hi"
    calls = [tc[0] for _, tc in deltas if tc]
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert len(calls) > 2 and all("name" not in c["function"] and "id" not in c for c in calls[1:])
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == args


@pytest.mark.parametrize(("template", "cut"), [
    (QWEN_TEMPLATE, '{"name":'),  # the prompt opened `<tool_call>\n`; max_tokens ended the output here
    (QWEN_TEMPLATE, '{"name": "get_weather", "arguments": {"city": "Pa'),
    (LLAMA_TEMPLATE, '{"name": "get_weather", "parameters": {'),
])
def test_a_forced_call_cut_short_is_no_call_and_no_text_whole_and_streamed(template: str, cut: str) -> None:
    plan = plan_tools(template, [WEATHER, Function("get_time", None, None)], "required", True, False)
    assert plan is not None and plan.forced
    assert split_whole(plan.splitter(), cut) == ("", [])
    for size in (1, 4, 1000):
        sc = StreamCalls(plan.splitter())
        deltas = [d for k in range(0, len(cut), size) for d in sc.deltas(cut[k:k + size], False)]
        assert deltas + sc.deltas("", True) == [] and sc.calls == 0
    whole = '{"name": "get_time", "arguments": {}}' if template == QWEN_TEMPLATE else \
        '{"name": "get_time", "parameters": {}}'
    assert split_whole(plan.splitter(), whole) == ("", [Call("get_time", "{}")])  # a whole one still is a call


def nested_call(levels: int) -> str:
    """A call whose JSON (the outer object counted) nests `levels` deep."""
    return '{"name": "get_time", "arguments": {"a": ' + "[" * (levels - 2) + "]" * (levels - 2) + "}}"


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 5000])
def test_a_call_the_model_nests_past_the_limit_is_text_never_a_crash(levels: int) -> None:
    body = nested_call(levels)
    for text in (f"<tool_call>\n{body}\n</tool_call>", body, f"```json\n{body}\n```"):
        assert cuts(lambda: Hermes().splitter(NAMES, forced=False), text, 1000) == [Text(text)]
    assert cuts(lambda: Llama3().splitter(NAMES, forced=False), body, 1000) == [Text(body)]
    args = '"{\\"a\\": ' + "[" * levels + "]" * levels + '}"'  # arguments written as a JSON string
    text = f'<tool_call>{{"name": "get_time", "arguments": {args}}}</tool_call>'
    assert cuts(lambda: Hermes().splitter(NAMES, forced=False), text, 1000) == [Text(text)]
    ok = nested_call(MAX_JSON_DEPTH)
    assert [type(e) for e in cuts(lambda: Hermes().splitter(NAMES, forced=False), ok, 1000)] == [Call]


def test_the_stops_a_plan_adds_fit_beside_the_clients_most_in_the_engines_check() -> None:
    client = tuple(f"s{i}" for i in range(MAX_STOPS))
    for template in (QWEN_TEMPLATE, LLAMA_TEMPLATE):
        for choice in ("auto", "required", "get_weather"):
            plan = plan_tools(template, [WEATHER], choice, False, False)
            assert plan is not None and len(plan.stops) <= MAX_ADDED_STOPS
            check_sampling(SamplingParams(max_tokens=1, stop=client + plan.stops))
    with pytest.raises(InvalidRequest) as e:  # a peer's frame past any API request's stops is still refused
        check_sampling(SamplingParams(max_tokens=1, stop=client + ("x",) * (MAX_ADDED_STOPS + 1)))
    assert e.value.param == "stop"

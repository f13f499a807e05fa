"""The clients people reach a server with, unmodified, on Qwen2.5-Coder-0.5B-Instruct, unified and disaggregated:
the OpenAI Agents SDK on both of its model classes (Responses and Chat Completions) with a function tool round
trip, and the Responses model's logprobs equal to chat's; instructor in TOOLS and JSON_SCHEMA modes; LangChain's
ChatOpenAI with bind_tools, whole and streamed; LiteLLM's completion through kvseal as an OpenAI-compatible base.
Each client is used as its documentation shows: only the base URL, the key and the model name are kvseal's.
(The anthropic SDK has its own module: test_anthropic_qwen.py.)"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

import httpx
import instructor
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.helpers.procs import Server
from tests.helpers.qwen_server import KEYS as QWEN_KEYS

pytestmark = pytest.mark.e2e
MODEL = "qwen2.5-coder-0.5b-instruct"
KEY = QWEN_KEYS["clients"]  # this module's tenant on the shared server
# LiteLLM fetches a price list from GitHub at import unless told to use its own copy (no network in the suite)
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
set_tracing_disabled(True)  # the Agents SDK sends its traces to OpenAI's servers otherwise
ASK = "What's the weather in Paris?"
# the tool's answer tells the 0.5B model to write text now (else it may call the tool again, turn after turn)
RESULT = "Paris: 21°C, sunny.\nNow write the answer for the user in plain text, do not call the tool again."


@dataclass
class Base:
    url: str  # the OpenAI-compatible base URL every client is given: the server's /v1

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def base(qwen_server: Server) -> Base:
    return Base(qwen_server.url + "/v1")


def agent_run(base: Base, responses: bool, stream: bool) -> tuple[Any, list[str], list[str]]:
    """An Agents SDK agent with one function tool, run to its end: (the run's result, the cities the tool was
    called with, the paths of the requests the SDK sent)."""
    cities: list[str] = []
    paths: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return RESULT

    async def run() -> Any:
        async def seen(r: httpx.Request) -> None:
            paths.append(r.url.path)

        client = openai.AsyncOpenAI(base_url=base.url, api_key=KEY, max_retries=0,
                                    http_client=httpx.AsyncClient(timeout=600, event_hooks={"request": [seen]}))
        kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
        agent = Agent(name="weather", instructions="Answer in one short sentence.", tools=[get_weather],
                      model=kind(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(temperature=0, max_tokens=48))
        if not stream:
            return await Runner.run(agent, ASK, max_turns=3)
        result = Runner.run_streamed(agent, ASK, max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    return asyncio.run(run()), cities, paths


def round_trip(result: Any, cities: list[str]) -> None:
    """The model called the tool, the SDK ran it and sent its output back, and the model answered in text."""
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert cities == ["Paris"] and result.new_items[1].output == RESULT
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_the_agents_sdk_on_the_responses_model_runs_a_tool_round_trip(base: Base) -> None:
    # the SDK sends `include: []` on every request: once a 400 ("include: this field is not supported")
    result, cities, paths = agent_run(base, responses=True, stream=False)
    round_trip(result, cities)
    assert paths == ["/v1/responses"] * 2
    streamed, cities, paths = agent_run(base, responses=True, stream=True)
    round_trip(streamed, cities)
    assert paths == ["/v1/responses"] * 2 and streamed.final_output == result.final_output


def test_the_agents_sdk_on_the_chat_completions_model_runs_a_tool_round_trip(base: Base) -> None:
    result, cities, paths = agent_run(base, responses=False, stream=False)
    round_trip(result, cities)
    assert paths == ["/v1/chat/completions"] * 2


def test_the_agents_sdk_asks_for_logprobs_and_gets_chats(base: Base) -> None:
    """top_logprobs on an agent without tools: the SDK sends include ["message.output_text.logprobs"] with
    `tools: []`; the answer's logprobs are those chat completions gives for the same prompt."""
    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=base.url, api_key=KEY, max_retries=0, timeout=600)
        agent = Agent(name="plain", instructions="Be brief.", model=OpenAIResponsesModel(model=MODEL,
                                                                                        openai_client=client),
                      model_settings=ModelSettings(temperature=0, max_tokens=24, top_logprobs=2))
        return await Runner.run(agent, "Say hi.")

    result = asyncio.run(run())
    (part,) = result.raw_responses[0].output[0].content
    chat = base.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}],
        temperature=0, max_tokens=24, logprobs=True, top_logprobs=2)
    want = chat.choices[0].logprobs.content
    assert part.text == result.final_output == chat.choices[0].message.content
    assert [(x.token, x.logprob) for x in part.logprobs] == [(x.token, x.logprob) for x in want]
    assert [[t.token for t in x.top_logprobs] for x in part.logprobs] == [
        [t.token for t in x.top_logprobs] for x in want] and all(len(x.top_logprobs) == 2 for x in want)
    with base.openai().responses.stream(model=MODEL, instructions="Be brief.", input="Say hi.", temperature=0,
                                        max_output_tokens=24, top_logprobs=2,
                                        include=["message.output_text.logprobs"]) as stream:
        deltas = [x for e in stream if e.type == "response.output_text.delta" for x in e.logprobs]
        final = stream.get_final_response()
    (streamed,) = final.output[0].content
    assert [(x.token, x.logprob) for x in deltas] == [(x.token, x.logprob) for x in streamed.logprobs] == [
        (x.token, x.logprob) for x in want]


class City(BaseModel):
    name: str
    country: str


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_extracts_a_model(base: Base, mode: str) -> None:
    client = instructor.from_openai(base.openai(), mode=instructor.Mode[mode])
    city = client.chat.completions.create(
        model=MODEL, response_model=City, max_retries=0, temperature=0, max_tokens=48,
        messages=[{"role": "user", "content": "Paris is the capital of France. Extract the city."}])
    assert isinstance(city, City) and (city.name, city.country) == ("Paris", "France")


def test_langchain_binds_a_tool_whole_and_streamed(base: Base) -> None:
    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return RESULT

    llm = ChatOpenAI(base_url=base.url, api_key=KEY, model=MODEL, temperature=0, max_tokens=48, max_retries=0)
    whole = llm.bind_tools([get_weather]).invoke(ASK)
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [("get_weather", {"city": "Paris"})]
    chunks = list(llm.bind_tools([get_weather]).stream(ASK))
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("get_weather", {"city": "Paris"})]
    text = list(llm.stream("Count from 1 to 5, separated by commas."))
    assert len(text) > 2 and "".join(str(c.content) for c in text).startswith("1, 2, 3, 4, 5")


def test_litellm_completion_through_an_openai_compatible_base(base: Base) -> None:
    import litellm  # here: after LITELLM_LOCAL_MODEL_COST_MAP above

    ask = [{"role": "user", "content": "Count from 1 to 5, separated by commas."}]
    kw: dict[str, Any] = {"model": "openai/" + MODEL, "api_base": base.url, "api_key": KEY, "max_tokens": 24,
                          "temperature": 0}
    whole = litellm.completion(messages=ask, **kw)
    assert whole.choices[0].message.content.startswith("1, 2, 3, 4, 5") and whole.usage.completion_tokens > 0
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(messages=ask, stream=True, **kw))
    assert streamed == whole.choices[0].message.content


def test_include_asks_only_for_what_kvseal_has(base: Base) -> None:
    """An empty include is no request; logprobs are served (above); anything else is a 400 that names it."""
    c = base.openai()
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4,
                           include=["message.output_text.logprobs", "reasoning.encrypted_content"])
    assert err.value.body["param"] == "include" and "'reasoning.encrypted_content'" in err.value.body["message"]
    assert c.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4, include=[]).output_text

"""OpenAI request bodies, validated. Anything out of range is a 400 with the parameter named.

Extensions that vLLM and SGLang users expect are accepted too: top_k, min_tokens, ignore_eos,
stop_token_ids, cache_salt, return_token_ids, priority; and kvseal's speculative (false: this request never
drafts). A field kvseal does not implement (logit_bias, ...) is a 400 that names it, never silently dropped (seal 2:
no stand-in answers); a field sent as null counts as absent.
Tools (api/tools/) are honoured for templates kvseal has a call parser for, and a 400 naming `tools` otherwise.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from kvseal.api.json_depth import TOO_DEEP, TooDeep, bounded, loads
from kvseal.errors import InvalidRequest
from kvseal.wire.messages import MAX_STOPS

MAX_N = 16  # samples per request (each is a request of its own on the workers)
_I32 = 2**31 - 1  # integers travel between processes as msgpack int64: bound them at the door
# a JSON object the body carries and kvseal walks again (a tool's schema, a tool_use input): api/json_depth.py
JsonObject = Annotated[dict[str, Any], AfterValidator(bounded)]


class Strict(BaseModel):
    """A body part whose unknown fields are refused by name (extra_forbidden -> 400); null means absent."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.model_fields}
        return data


class StreamOptions(Strict):
    include_usage: bool = False


class ContentPart(Strict):
    type: Literal["text"]
    text: str


_FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class FunctionDef(Strict):
    name: Annotated[str, Field(pattern=_FUNCTION_NAME)]
    description: str | None = None
    parameters: JsonObject | None = None  # a JSON schema; enforced under tool_choice required or named
    strict: bool | None = None


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(Strict):
    name: str
    arguments: str  # a JSON object as text, as OpenAI writes it


class ToolCallPart(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallPart] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages only

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class JsonSchema(Strict):
    name: str = "response"
    description: str | None = None
    schema_: JsonObject = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormatBody(Strict):
    """OpenAI's response_format: free text, any JSON object, or JSON that follows a schema (engine/structured.py)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormatBody:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("give json_schema (with its schema) exactly when type is json_schema")
        return self


class _SamplingFields(Strict):
    model: str
    max_tokens: Annotated[int, Field(ge=1, le=_I32)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=_I32)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=_I32)]] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    presence_penalty: Annotated[float, Field(ge=0.0, le=0.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=0.0, le=0.0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=_I32)] = 0
    user: str | None = None
    cache_salt: str | None = None
    return_token_ids: bool = False  # vLLM's extension: choices[0].token_ids holds the generated ids
    response_format: ResponseFormatBody | None = None
    # vLLM's: lower is scheduled earlier; it orders this request among its own tenant's (never across tenants)
    priority: Annotated[int, Field(ge=-(2**31), le=_I32)] = 0
    # kvseal's: false, and this request never drafts (engine/drafts.py); true leaves it to the engine's --speculative
    speculative: bool = True

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        for s in stops:
            s.encode("utf-8")  # a lone surrogate is not text: UnicodeEncodeError -> 400
        return v

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, v: str | None) -> str | None:
        if v is not None:
            v.encode("utf-8")  # it travels to the workers as msgpack text: a lone surrogate -> 400 here
        return v

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=_I32)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None  # OpenAI's bound
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def choice_name(self) -> str | None:
        """tool_choice as plan_tools takes it: None, "none", "auto", "required" or a function's name."""
        c = self.tool_choice
        return c.function.name if isinstance(c, NamedToolChoice) else c


class CompletionRequest(_SamplingFields):
    prompt: str | Annotated[list[Annotated[int, Field(ge=0, le=_I32)]], Field(min_length=1)] | list[str]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: Literal[False] = False
    suffix: None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None


class TokenizeCompletionRequest(Strict):
    """vLLM's /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Strict):
    """vLLM's /tokenize with messages: the chat template is rendered first, as /v1/chat/completions does."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=_I32)]]


def template_arguments(text: str, param: str) -> Any:
    """A call's arguments as templates render them (`arguments | tojson`): the object, or the text if not JSON.
    Raises InvalidRequest naming param for JSON nested past MAX_JSON_DEPTH."""
    try:
        return loads(text)
    except TooDeep:
        raise InvalidRequest(f"{param}: {TOO_DEEP}", param=param) from None
    except ValueError:
        return text


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template reads them (transformers' shape). Raises InvalidRequest for tool fields
    on a role that cannot carry them."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise InvalidRequest(f"messages.{i}.tool_calls: only assistant messages carry tool calls",
                                     param=f"messages.{i}.tool_calls")
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": template_arguments(
                    c.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments")}}
                for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            if m.role != "tool":
                raise InvalidRequest(f"messages.{i}.tool_call_id: only tool messages answer a tool call",
                                     param=f"messages.{i}.tool_call_id")
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out

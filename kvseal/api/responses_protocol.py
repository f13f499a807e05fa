"""OpenAI Responses request bodies, validated (unknown fields are a 400 naming them), and their translation into
the chat-template conversation the other routes use.

A conversation continued with previous_response_id is the stored conversation of that response (its input and
its output) followed by this request's input; `instructions` are not carried over (OpenAI's rule): each request's
own become the system message.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from kvseal.api.protocol import _I32, JsonObject, Strict, template_arguments
from kvseal.api.tools.plan import Function

_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
# OpenAI's bounds: metadata is stored with the response and echoed, never tokenized, so never charged to tpm
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]
MAX_TOOLS = 128
# what `include` may ask for that kvseal has: the sampled tokens' logprobs. An empty list asks for nothing (the
# OpenAI Agents SDK sends `include: []` on every request); any other value (file search results, reasoning's
# encrypted content, ...) names something kvseal never produces and is a 400 naming it, never silently dropped.
INCLUDABLE = ("message.output_text.logprobs",)


def _includable(values: list[str]) -> list[str]:
    for v in values:
        if v not in INCLUDABLE:
            raise ValueError(f"{v!r} cannot be included: kvseal has no such output; it can include "
                             + ", ".join(INCLUDABLE))
    return values


class InputText(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # output_text of an earlier answer carries them; they are not read
    logprobs: list[Any] | None = None  # as annotations: an earlier answer's, sent back by clients, not read


class InputMessage(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


Item = FunctionCallItem | FunctionCallOutputItem | InputMessage


class FunctionTool(Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=_NAME)]
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None  # the schema is enforced under tool_choice required or named


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text"]


class TextConfig(Strict):
    format: TextFormat | None = None


class ResponsesRequest(Strict):
    model: str
    input: str | Annotated[list[Item], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: Annotated[int, Field(ge=1, le=_I32)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    include: Annotated[list[str], AfterValidator(_includable), Field(max_length=16)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # with include's logprobs: alternatives each
    stream: bool = False
    store: bool = True
    metadata: Metadata | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None
    user: str | None = None

    def logprobs(self) -> int | None:
        """The engine's logprobs setting: None (off) unless include asks for them; then top_logprobs (0: the
        sampled token's alone). top_logprobs without include returns none, as OpenAI's and vLLM's servers do."""
        return (self.top_logprobs or 0) if self.include and INCLUDABLE[0] in self.include else None

    def choice(self) -> str | None:
        c = self.tool_choice
        return c.name if isinstance(c, NamedFunction) else c

    def functions(self) -> list[Function] | None:
        """None for no tools: an empty list asks for none (OpenAI's Responses API accepts it, and the Agents SDK
        sends it for an agent without tools), unlike chat completions', where OpenAI refuses `tools: []`."""
        return [Function(t.name, t.description, t.parameters) for t in self.tools] if self.tools else None

    def input_messages(self) -> list[dict[str, Any]]:
        """This request's input as chat-template messages (without the instructions)."""
        items: list[Item] = ([InputMessage(role="user", content=self.input)] if isinstance(self.input, str)
                             else self.input)
        return items_to_messages(items)


def items_to_messages(items: list[Item]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for k, item in enumerate(items):
        if isinstance(item, InputMessage):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {
                "name": item.name, "arguments": template_arguments(item.arguments, f"input.{k}.arguments")}}
            if out and out[-1]["role"] == "assistant":  # the calls of one answer are one assistant turn
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


"""Anthropic Messages request bodies, validated (unknown fields are a 400 naming them, as on the OpenAI routes),
and their translation into the chat-template messages and tool plan the OpenAI chat route uses.

`cache_control` on a block or tool is accepted and needs nothing: kvseal's prefix cache keeps every tenant's full
prompt pages without being asked (seal 9 keys it by tenant). Content kinds kvseal cannot read (images, documents,
thinking) are refused by name.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from kvseal.api.protocol import _I32, JsonObject, Strict
from kvseal.api.tools.plan import Function
from kvseal.wire.messages import MAX_STOPS

_TOOL_NAME = r"^[A-Za-z0-9_-]{1,128}$"


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: JsonObject
    cache_control: CacheControl | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {body}" if self.is_error else body


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(Strict):
    name: Annotated[str, Field(pattern=_TOOL_NAME)]
    description: str | None = None
    input_schema: JsonObject
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Metadata(Strict):
    user_id: str | None = None


class CountTokensRequest(Strict):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None  # the prefix cache needs no asking (see the top)

    def choice(self) -> str | None:
        """tool_choice as plan_tools takes it."""
        c = self.tool_choice
        if c is None:
            return None
        if c.type == "tool":
            return c.name or ""
        return {"auto": "auto", "any": "required", "none": "none"}[c.type]

    @property
    def parallel(self) -> bool:
        return not (self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use)

    def functions(self) -> list[Function] | None:
        return None if self.tools is None else [Function(t.name, t.description, t.input_schema) for t in self.tools]

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat templates read it: tool_use blocks become an assistant's tool_calls,
        tool_result blocks become tool messages (before the user's text of the same turn, as Anthropic orders)."""
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        for m in self.messages:
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
            if m.role == "assistant":
                calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                         for b in m.content if isinstance(b, ToolUseBlock)]
                out.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
                continue
            out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                    for b in m.content if isinstance(b, ToolResultBlock)]
            if text or not any(isinstance(b, ToolResultBlock) for b in m.content):
                out.append({"role": "user", "content": text})
        return out


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1, le=_I32)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=_I32)] | None = None
    stream: bool = False
    metadata: Metadata | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            if len(v) > MAX_STOPS:
                raise ValueError(f"at most {MAX_STOPS} stop sequences")
            if any(s == "" for s in v):
                raise ValueError("stop sequences must not be empty")
            for s in v:
                s.encode("utf-8")
        return v


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (a JSON object as text, api/tools/calls.py) as a tool_use block's input."""
    out: dict[str, Any] = json.loads(arguments)
    return out

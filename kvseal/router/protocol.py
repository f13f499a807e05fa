"""OpenAI request bodies, validated. Anything out of range is a 400 with the parameter named.

Extensions that vLLM and SGLang users expect are accepted too: top_k, min_tokens, ignore_eos,
stop_token_ids, cache_salt. Unknown fields are ignored, as those servers do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_MAX_STOPS = 16
_I32 = 2**31 - 1  # integers travel between processes as msgpack int64: bound them at the door


class StreamOptions(BaseModel):
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: Annotated[int, Field(ge=1, le=_I32)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=_I32)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
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

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > _MAX_STOPS:
            raise ValueError(f"at most {_MAX_STOPS} stop sequences")
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


class CompletionRequest(_SamplingFields):
    prompt: str | Annotated[list[Annotated[int, Field(ge=0, le=_I32)]], Field(min_length=1)] | list[str]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: Literal[False] = False
    suffix: None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]

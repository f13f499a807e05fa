"""GenerateDelta -> OpenAI response objects (chat and completion, whole and streamed)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvseal.model.tokenizer import Tokenizer
from kvseal.wire.messages import TokenLogprob


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; cached: prompt tokens whose KV came from the prefix cache."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _tok(tokenizer: Tokenizer, tid: int) -> str:
    return tokenizer.decode([tid], skip_special_tokens=False)


def chat_logprobs(tokenizer: Tokenizer, lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = _tok(tokenizer, tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                        for x in lps]}


def completion_logprobs(tokenizer: Tokenizer, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    tokens = [_tok(tokenizer, x.token_id) for x in lps]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [x.logprob for x in lps],
        "top_logprobs": [{_tok(tokenizer, t): v for t, v in x.top} for x in lps],
        "text_offset": offsets,
    }


@dataclass
class Choice:
    """One sample's whole answer."""

    text: str
    finish: str
    logprobs: dict[str, Any] | None
    token_ids: list[int]
    tool_calls: list[dict[str, Any]] | None = None  # chat only: the answer's calls (content None when no text)


class ResponseBuilder:
    """Builds the objects of one response; `chat` selects chat.completion vs text_completion shapes."""

    def __init__(self, request_id: str, model: str, chat: bool, token_ids: bool = False) -> None:
        self.id, self.model, self.chat, self.token_ids = request_id, model, chat, token_ids
        self.created = int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, choices: list[Choice], use: dict[str, Any]) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            choice: dict[str, Any] = {"index": i}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": c.text if c.text or not c.tool_calls else None}
                if c.tool_calls:
                    choice["message"]["tool_calls"] = c.tool_calls
            else:
                choice["text"] = c.text
            choice |= {"logprobs": c.logprobs, "finish_reason": c.finish}
            if self.token_ids:
                choice["token_ids"] = c.token_ids
            out.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._base(obj), "choices": out, "usage": use}

    def chunk(self, text: str | None, finish: str | None, logprobs: dict[str, Any] | None,
              role: bool = False, token_ids: list[int] | None = None, index: int = 0,
              tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls is not None:
                delta["tool_calls"] = tool_calls
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice |= {"logprobs": logprobs, "finish_reason": finish}
        if self.token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [choice]}

    def usage_chunk(self, use: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": use}

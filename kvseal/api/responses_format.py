"""Generated text -> OpenAI's Responses shapes: a whole `response` with its output items (a message with
output_text, function_call items), or the stream's events (response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta, ...done,
response.function_call_arguments.delta/.done, response.output_item.done, response.completed), each with its
sequence_number, as the openai client's stream helper assembles them. Calls come from the template family's
splitter (api/tools/), as on the other routes."""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvseal.api.openai_format import chat_logprobs
from kvseal.api.protocol import template_arguments
from kvseal.api.respond import sse
from kvseal.api.tools.calls import Call, Event, Splitter, Text, call_id
from kvseal.api.tools.output import ARG_FRAGMENT
from kvseal.errors import KvsealError
from kvseal.model.tokenizer import Tokenizer
from kvseal.wire.messages import GenerateDelta, TokenLogprob


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


def text_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": new_id("msg_"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def logprob_entries(tok: Tokenizer, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
    """An output_text's `logprobs` (include: message.output_text.logprobs): chat's entries, token by token."""
    entries: list[dict[str, Any]] = chat_logprobs(tok, lps)["content"]
    return entries


def call_item(c: Call, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": new_id("fc_"), "call_id": call_id(), "name": c.name,
            "arguments": c.arguments, "status": status}


def output_items(events: list[Event]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, Call):
            out.append(call_item(e))
        elif out and out[-1]["type"] == "message":
            out[-1]["content"][0]["text"] += e.text
        elif e.text:
            out.append(text_item(e.text))
    return out


def assistant_turn(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output as the assistant message a continued conversation renders."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": template_arguments(i["arguments"], "arguments")}}
             for i in items if i["type"] == "function_call"]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


class Shell:
    """What a Response says besides its output: the request's settings, echoed."""

    def __init__(self, rid: str, model: str, settings: dict[str, Any]) -> None:
        self.rid, self.model, self.settings, self.created = rid, model, settings, int(time.time())

    def body(self, status: str, output: list[dict[str, Any]], final: GenerateDelta | None) -> dict[str, Any]:
        use = None
        if final is not None:
            use = {"input_tokens": final.prompt_tokens, "input_tokens_details": {"cached_tokens": final.cached_tokens},
                   "output_tokens": final.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": final.prompt_tokens + final.completion_tokens}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "error": None, "incomplete_details": incomplete,
                "usage": use, **self.settings}


def status_of(final: GenerateDelta) -> str:
    return "incomplete" if final.final == "length" else "completed"


class ResponsesStream:
    """One sample's Responses event stream (api/respond.StreamFormat). done(body, output) is called with the
    finished Response before its last event goes out (the route stores it there)."""

    def __init__(self, shell: Shell, splitter: Splitter | None,
                 done: Callable[[dict[str, Any], list[dict[str, Any]]], Awaitable[None]],
                 tok: Tokenizer | None = None) -> None:
        self.shell, self.splitter, self.done, self.tok = shell, splitter, done, tok  # tok: logprobs asked for
        self._answered: tuple[dict[str, Any], list[dict[str, Any]]] | None = None  # for settle()
        self.seq = 0
        self.pending: list[dict[str, Any]] = []  # logprobs of tokens whose text has not gone out yet
        self.items: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None  # the open message item

    def _ev(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **fields}, kind)

    def opening(self) -> list[str]:
        body = self.shell.body("in_progress", [], None)
        return [self._ev("response.created", response=body), self._ev("response.in_progress", response=body)]

    def delta(self, i: int, d: GenerateDelta) -> list[str]:
        if self.tok is not None and d.logprobs:
            self.pending += logprob_entries(self.tok, d.logprobs)
        events: list[Event] = [Text(d.text)] if self.splitter is None and d.text else []
        if self.splitter is not None:
            events = self.splitter.feed(d.text) if d.text else []
            if d.final is not None:
                events += self.splitter.finish()
        out = [e for ev in events for e in self._event(ev)]
        if d.final is not None:
            status = status_of(d)
            out += self._close(status)
            body = self.shell.body(status, self.items, d)
            self._answered = (body, self.items)
            out.append(self._ev("response.completed" if status == "completed" else "response.incomplete",
                                response=body))
        return out

    async def settle(self) -> None:
        if self._answered is not None:
            await self.done(*self._answered)

    def closing(self, finals: list[GenerateDelta]) -> list[str]:
        return []

    def error(self, err: KvsealError) -> str:
        return self._ev("error", code=err.code or err.type, message=err.message, param=err.param)

    def _event(self, e: Event) -> list[str]:
        if isinstance(e, Text):
            if not e.text:
                return []
            out: list[str] = []
            if self.message is None:
                self.message = text_item("", "in_progress")
                self.items.append(self.message)
                added = {**self.message, "content": []}
                out += [self._ev("response.output_item.added", output_index=len(self.items) - 1, item=added),
                        self._ev("response.content_part.added", item_id=self.message["id"],
                                 output_index=len(self.items) - 1, content_index=0,
                                 part={"type": "output_text", "text": "", "annotations": []})]
            self.message["content"][0]["text"] += e.text
            lps, self.pending = self.pending, []
            if self.tok is not None:
                self.message["content"][0].setdefault("logprobs", []).extend(lps)
            return [*out, self._ev("response.output_text.delta", item_id=self.message["id"],
                                   output_index=len(self.items) - 1, content_index=0, delta=e.text, logprobs=lps)]
        out = self._close()
        item = call_item(e)
        self.items.append(item)
        at = len(self.items) - 1
        out.append(self._ev("response.output_item.added", output_index=at,
                            item={**item, "arguments": "", "status": "in_progress"}))
        out += [self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                         delta=e.arguments[k:k + ARG_FRAGMENT]) for k in range(0, len(e.arguments), ARG_FRAGMENT)]
        return [*out, self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                               name=e.name, arguments=e.arguments),
                self._ev("response.output_item.done", output_index=at, item=item)]

    def _close(self, status: str = "completed") -> list[str]:
        if self.message is None:
            return []
        m, self.message = self.message, None
        m["status"] = status  # a message cut by max_output_tokens is incomplete
        at, part = self.items.index(m), m["content"][0]
        out = []
        if self.pending:  # tokens that ended as no text (the end of turn's) had logprobs too: each in one delta
            part["logprobs"].extend(self.pending)
            out.append(self._ev("response.output_text.delta", item_id=m["id"], output_index=at, content_index=0,
                                delta="", logprobs=self.pending))
            self.pending = []
        return [*out, self._ev("response.output_text.done", item_id=m["id"], output_index=at, content_index=0,
                               text=part["text"], logprobs=part.get("logprobs", [])),
                self._ev("response.content_part.done", item_id=m["id"], output_index=at, content_index=0, part=part),
                self._ev("response.output_item.done", output_index=at, item=m)]

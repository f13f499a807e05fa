"""Splitter events -> OpenAI's chat shapes: `message.tool_calls` of a whole answer, and the streamed deltas
(`index`, `id`, `type` and `function.name` once, then `function.arguments` fragments), as the openai client's
stream helpers assemble them."""

from __future__ import annotations

from typing import Any

from kvseal.api.tools.calls import Call, Event, Splitter, Text, call_id

ARG_FRAGMENT = 48  # characters of arguments per streamed delta


def split_whole(splitter: Splitter, text: str) -> tuple[str, list[Call]]:
    """The content text and the calls of a whole answer (the same splitter a stream uses)."""
    events = splitter.feed(text) + splitter.finish()
    return "".join(e.text for e in events if isinstance(e, Text)), [e for e in events if isinstance(e, Call)]


def whole_calls(calls: list[Call]) -> list[dict[str, Any]]:
    return [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def call_deltas(call: Call, index: int) -> list[dict[str, Any]]:
    """The tool_calls deltas of one call: the first names it, the others carry its arguments in fragments."""
    first = {"index": index, "id": call_id(), "type": "function", "function": {"name": call.name, "arguments": ""}}
    args = call.arguments
    return [first, *({"index": index, "function": {"arguments": args[k:k + ARG_FRAGMENT]}}
                     for k in range(0, len(args), ARG_FRAGMENT))]


class StreamCalls:
    """One sample's stream: events in, (content, tool_calls delta) pairs out, numbering the calls."""

    def __init__(self, splitter: Splitter) -> None:
        self.splitter, self.calls = splitter, 0

    def deltas(self, text: str, final: bool) -> list[tuple[str | None, list[dict[str, Any]] | None]]:
        events: list[Event] = self.splitter.feed(text) if text else []
        if final:
            events += self.splitter.finish()
        out: list[tuple[str | None, list[dict[str, Any]] | None]] = []
        for e in events:
            if isinstance(e, Text):
                out.append((e.text, None))
            else:
                out += [(None, [d]) for d in call_deltas(e, self.calls)]
                self.calls += 1
        return out

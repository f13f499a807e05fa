"""Llama 3.x JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`, several separated by `;`), as Meta's template asks for.

An answer whose first non-blank text is `{` or `<|python_tag|>` is held whole and parsed at the end: every part a
valid call gives calls, anything else gives the answer as text. Any other answer streams as text.
"""

from __future__ import annotations

from typing import Any

from kvseal.api.tools.calls import Call, Event, Text, json_calls

TAG = "<|python_tag|>"


def parse_calls(text: str, names: frozenset[str]) -> list[Call] | None:
    return json_calls(text.strip().removeprefix(TAG), names, ("parameters", "arguments"))


class Llama3Splitter:
    def __init__(self, names: frozenset[str], forced: bool) -> None:
        self.names, self.buf = names, ""
        self.mode: str | None = "calls" if forced else None  # None: undecided, "text" or "calls"

    def feed(self, text: str) -> list[Event]:
        if self.mode == "text":
            return [Text(text)] if text else []
        self.buf += text
        head = self.buf.lstrip()
        if self.mode is None and head and not TAG.startswith(head[: len(TAG)]) and not head.startswith("{"):
            self.mode, out, self.buf = "text", self.buf, ""
            return [Text(out)]
        if self.mode is None and (head.startswith(("{", TAG))):
            self.mode = "calls"
        return []

    def finish(self) -> list[Event]:
        out, self.buf = self.buf, ""
        if self.mode == "calls":
            calls = parse_calls(out, self.names)
            if calls is not None:
                return list(calls)
        return [Text(out)] if out else []


class Llama3:
    name = "llama3_json"
    forced_prefix = ""
    single_call_stops: tuple[str, ...] = ()  # `;` may be text: a second call is dropped by the plan instead

    def splitter(self, names: frozenset[str], forced: bool) -> Llama3Splitter:
        return Llama3Splitter(names, forced)

    def call_schema(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
                "required": ["name", "parameters"], "additionalProperties": False}

    @staticmethod
    def detects(template: str) -> bool:
        return "<|start_header_id|>" in template and "tools" in template and '"parameters"' in template

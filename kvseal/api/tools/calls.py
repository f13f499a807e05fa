"""What a tool-call splitter emits: plain text, or a call whose arguments are a parsed JSON object.

Invariant: a Call is emitted only after its whole text was read and parsed, with a name the request offered and
arguments that are a JSON object; anything else stays text (a broken call is never returned as a call). JSON nested
past api/json_depth.MAX_JSON_DEPTH is not a call either: a model can write `[[[[` as well as a client.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Protocol

from kvseal.api.json_depth import loads, raw_decode


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object, as compact text (OpenAI's `function.arguments`)

    @property
    def args(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.arguments)
        return out


Event = Text | Call


class Splitter(Protocol):
    """Generated text in, events out; finish() once at the end flushes what was held back."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def call_id(prefix: str = "call_") -> str:
    return prefix + secrets.token_hex(12)


def make_call(obj: Any, names: frozenset[str], args_key: str) -> Call | None:
    """A Call from a decoded JSON value {"name": ..., args_key: {...}}, or None when it is not a valid one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get(args_key, {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict) or set(obj) - {"name", args_key}:
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def json_calls(body: str, names: frozenset[str], keys: tuple[str, ...]) -> list[Call] | None:
    """Calls from JSON objects one after the other (blanks or `;` between), each {"name", one of keys}; None
    unless all of body is such calls."""
    calls, i = list[Call](), 0
    while True:
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
        if i == len(body):
            return calls or None
        try:
            obj, i = raw_decode(body, i)
        except ValueError:
            return None
        call = next((c for k in keys if (c := make_call(obj, names, k)) is not None), None)
        if call is None:
            return None
        calls.append(call)


def held_prefix(buf: str, tag: str) -> int:
    """The length of the longest suffix of buf that is a proper prefix of tag: text that may start the tag."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


class Whitespace:
    """Defers trailing whitespace: before a call and at the end of an answer with calls it is dropped, before
    other text it is kept; the first text after a call starts at its first non-blank. The same in any cut."""

    def __init__(self) -> None:
        self.pending = ""
        self.calls = 0
        self.after_call = False

    def text(self, s: str) -> list[Event]:
        body = s.rstrip()
        if not body:
            self.pending += s
            return []
        out, self.pending = self.pending + body, s[len(body):]
        if self.after_call:
            out, self.after_call = out.lstrip(), False
        return [Text(out)]

    def call(self, c: Call) -> list[Event]:
        self.pending, self.calls, self.after_call = "", self.calls + 1, True
        return [c]

    def finish(self) -> list[Event]:
        out, self.pending = self.pending, ""
        return [Text(out)] if out and not self.calls else []

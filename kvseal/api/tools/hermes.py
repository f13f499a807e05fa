"""Qwen2.5 / Hermes tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks in the text.

Text outside the blocks streams as it comes, less a tail that may be the start of `<tool_call>` (held until the
next text decides it). A block is held whole until `</tool_call>` (or the end of the output: a model that stops
right after the JSON) and then becomes a Call, or, when it does not parse, the text it was.

Small models (Qwen2.5-Coder-0.5B among them) often answer a call as the bare JSON, without the tags, as
or in a ```json fence, as llama.cpp's Hermes parser also accepts: an answer whose first non-blank text is `{`
(or a fence whose first non-blank is) is held whole, and is calls only if all of it (less the fence) is
{"name", "arguments"} objects of offered functions; otherwise it is read as above.
"""

from __future__ import annotations

from typing import Any

from kvseal.api.json_depth import loads
from kvseal.api.tools.calls import Event, Whitespace, held_prefix, json_calls, make_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```"


def bare_opening(head: str) -> bool | None:
    """Whether an answer starting with head (no leading blanks) is a bare call: `{` or ```json {; None: undecided."""
    if head.startswith("{"):
        return True
    if not FENCE.startswith(head[:3]):
        return False
    rest = head[3:].lstrip()
    if len(head) < 3 or rest == "" or (len(rest) < 4 and "json".startswith(rest)):
        return None
    if rest.startswith("json"):
        rest = rest[4:].lstrip()
        if rest == "":
            return None
    return rest.startswith("{")


def unfenced(text: str) -> str:
    body = text.strip()
    if body.startswith(FENCE) and body.endswith(FENCE) and len(body) >= 6:
        body = body[3:-3].strip().removeprefix("json")
    return body


class HermesSplitter:
    def __init__(self, names: frozenset[str], forced: bool) -> None:
        # forced: the prompt already ends with OPEN (tool_choice required or named), the output starts in a block
        self.names, self.inside, self.buf = names, forced, ""
        self.ws = Whitespace()
        self.bare: bool | None = False if forced else None  # None: the answer's first non-blank is yet to come

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        if self.bare is None and self.buf.strip():
            self.bare = bare_opening(self.buf.lstrip())
        if self.bare is not False:
            return []  # undecided, or a bare JSON answer: held to the end
        return self._scan()

    def _scan(self) -> list[Event]:
        out: list[Event] = []
        while True:
            if self.inside:
                end = self.buf.find(CLOSE)
                if end < 0:
                    return out
                out += self._block(self.buf[:end], closed=True)
                self.buf, self.inside = self.buf[end + len(CLOSE):], False
            else:
                start = self.buf.find(OPEN)
                if start < 0:
                    keep = held_prefix(self.buf, OPEN)
                    out += self.ws.text(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                out += self.ws.text(self.buf[:start])
                self.buf, self.inside = self.buf[start + len(OPEN):], True

    def finish(self) -> list[Event]:
        if self.bare is not False:
            calls = json_calls(unfenced(self.buf), self.names, ("arguments",))
            if calls is not None:
                self.buf = ""
                return list(calls)
            self.bare = False
            out = self._scan()
            return out + self.finish()
        out = self._block(self.buf, closed=False) if self.inside else self.ws.text(self.buf)
        self.buf, self.inside = "", False
        return out + self.ws.finish()

    def _block(self, body: str, closed: bool) -> list[Event]:
        try:
            call = make_call(loads(body), self.names, "arguments")
        except ValueError:
            call = None
        if call is not None:
            return self.ws.call(call)
        return self.ws.text(OPEN + body + (CLOSE if closed else ""))


class Hermes:
    name = "hermes"
    forced_prefix = OPEN + "\n"  # appended to the prompt when a call is required: the grammar writes the JSON
    single_call_stops: tuple[str, ...] = (CLOSE,)  # parallel_tool_calls false: the output ends with the first call

    def splitter(self, names: frozenset[str], forced: bool) -> HermesSplitter:
        return HermesSplitter(names, forced)

    def call_schema(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"], "additionalProperties": False}

    @staticmethod
    def detects(template: str) -> bool:
        return OPEN in template and CLOSE in template

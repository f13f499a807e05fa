"""Generated text -> Anthropic's Messages shapes: a whole `message`, or the stream's event sequence
message_start, (content_block_start, content_block_delta..., content_block_stop)*, message_delta, message_stop,
as the anthropic client's stream helper assembles it. With tools, text and tool_use blocks come from the
template family's splitter (api/tools/), the same one the OpenAI routes use."""

from __future__ import annotations

import secrets
from typing import Any

from kvseal.api.anthropic_errors import anthropic_error
from kvseal.api.anthropic_protocol import tool_input
from kvseal.api.respond import Sample, sse
from kvseal.api.tools.calls import Call, Event, Splitter, Text, call_id
from kvseal.api.tools.output import ARG_FRAGMENT
from kvseal.errors import KvsealError
from kvseal.model.tokenizer import Tokenizer
from kvseal.wire.messages import GenerateDelta


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def stop_of(tok: Tokenizer, final: str, ids: list[int], text: str, stops: tuple[str, ...],
            called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). A stop sequence is cut from the text, so it is the one the full decode of the
    ids continues the text with."""
    if called:
        return "tool_use", None
    if final == "length":
        return "max_tokens", None
    if ids and ids[-1] in tok.eos_ids:
        return "end_turn", None
    rest = tok.decode(ids)[len(text):]
    hit = next((s for s in sorted(stops, key=len, reverse=True) if rest.startswith(s)), None)
    return ("stop_sequence", hit) if hit is not None else ("end_turn", None)


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """Anthropic counts cache reads apart from input_tokens."""
    return {"input_tokens": prompt - cached, "output_tokens": completion, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def blocks(events: list[Event]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, Text):
            if out and out[-1]["type"] == "text":
                out[-1]["text"] += e.text
            elif e.text:
                out.append({"type": "text", "text": e.text})
        else:
            out.append({"type": "tool_use", "id": call_id("toolu_"), "name": e.name, "input": tool_input(e.arguments)})
    return out


def whole_message(tok: Tokenizer, mid: str, model: str, s: Sample, splitter: Splitter | None,
                  stops: tuple[str, ...]) -> dict[str, Any]:
    assert s.final is not None
    events: list[Event] = (splitter.feed(s.text) + splitter.finish()) if splitter is not None else [Text(s.text)]
    content = blocks(events)
    reason, seq = stop_of(tok, s.final.final or "stop", s.ids, s.text, stops,
                          any(isinstance(e, Call) for e in events))
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": seq,
            "usage": usage(s.final.prompt_tokens, s.final.completion_tokens, s.final.cached_tokens)}


class MessagesStream:
    """One sample's Anthropic event stream (api/respond.StreamFormat)."""

    def __init__(self, tok: Tokenizer, mid: str, model: str, prompt_tokens: int, splitter: Splitter | None,
                 stops: tuple[str, ...]) -> None:
        self.tok, self.mid, self.model, self.prompt_tokens = tok, mid, model, prompt_tokens
        self.splitter, self.stops = splitter, stops
        self.ids: list[int] = []
        self.text = ""
        self.index = -1  # the open block's index, or of the last one
        self.open: str | None = None  # the open block's type
        self.called = False

    def opening(self) -> list[str]:
        msg: dict[str, Any] = {"id": self.mid, "type": "message", "role": "assistant", "model": self.model,
                               "content": [], "stop_reason": None, "stop_sequence": None,
                               "usage": usage(self.prompt_tokens, 0, 0)}
        return [_ev({"type": "message_start", "message": msg})]

    def delta(self, i: int, d: GenerateDelta) -> list[str]:
        self.ids += d.token_ids
        self.text += d.text
        events: list[Event] = []
        if self.splitter is None:
            events = [Text(d.text)] if d.text else []
        else:
            events = self.splitter.feed(d.text) if d.text else []
            if d.final is not None:
                events += self.splitter.finish()
        out = [e for ev in events for e in self._event(ev)]
        if d.final is not None:
            out += self._close()
            reason, seq = stop_of(self.tok, d.final, self.ids, self.text, self.stops, self.called)
            out.append(_ev({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                            "usage": {"output_tokens": d.completion_tokens}}))
        return out

    async def settle(self) -> None:
        pass

    def closing(self, finals: list[GenerateDelta]) -> list[str]:
        return [_ev({"type": "message_stop"})]

    def error(self, err: KvsealError) -> str:
        return sse(anthropic_error(err.status, err.message), "error")

    def _event(self, e: Event) -> list[str]:
        if isinstance(e, Text):
            if not e.text:
                return []
            out = [] if self.open == "text" else self._start({"type": "text", "text": ""})
            return [*out, _ev({"type": "content_block_delta", "index": self.index,
                               "delta": {"type": "text_delta", "text": e.text}})]
        self.called = True
        out = self._start({"type": "tool_use", "id": call_id("toolu_"), "name": e.name, "input": {}})
        args = e.arguments
        out += [_ev({"type": "content_block_delta", "index": self.index,
                     "delta": {"type": "input_json_delta", "partial_json": args[k:k + ARG_FRAGMENT]}})
                for k in range(0, len(args), ARG_FRAGMENT)]
        return out + self._close()

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return [*out, _ev({"type": "content_block_start", "index": self.index, "content_block": block})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_ev({"type": "content_block_stop", "index": self.index})]


def _ev(obj: dict[str, Any]) -> str:
    return sse(obj, str(obj["type"]))

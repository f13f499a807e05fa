"""The tool-call family of a chat template: which text the model writes for a call, and how to force one."""

from __future__ import annotations

from typing import Any, Protocol

from kvseal.api.tools.calls import Splitter
from kvseal.api.tools.hermes import Hermes
from kvseal.api.tools.llama3 import Llama3


class Family(Protocol):
    name: str
    forced_prefix: str  # appended to the rendered prompt when a call is forced; the grammar writes the rest
    single_call_stops: tuple[str, ...]  # stop strings that end the output after one call

    def splitter(self, names: frozenset[str], forced: bool) -> Splitter: ...

    def call_schema(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]: ...


def family_of(template: str | None) -> Family | None:
    """The family whose call format the template teaches the model; None when kvseal has no parser for it."""
    if not template:
        return None
    if Hermes.detects(template):
        return Hermes()
    if Llama3.detects(template):
        return Llama3()
    return None

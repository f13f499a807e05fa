"""What a request's tools ask of the generation: the template's tools, the parser, and for `required` or a named
function the grammar that forces one call of an offered function with arguments that follow its schema.

tool_choice:
- "none": the tools are left out of the prompt and the output is never parsed: no call can come back.
- "auto" (the default): the model may call; its output is parsed by the template's family (families.py).
- "required" / {"type": "function", "function": {"name": N}}: the prompt ends with the family's call opening and
  the output is constrained (engine/structured.py) to exactly one call, of N or of any offered function, whose
  arguments match that function's `parameters` schema. Only a whole call comes back: one cut short (by max_tokens
  or a stop sequence) gives no call and no text, never the partial markup (the prompt, not the model, opened it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvseal.api.tools.calls import Call, Event, Splitter
from kvseal.api.tools.families import Family, family_of
from kvseal.errors import InvalidRequest
from kvseal.wire.messages import ResponseFormat, response_format

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any] | None

    def template_form(self) -> dict[str, Any]:
        """The tool as chat templates expect it (transformers' shape: OpenAI's tool object)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters if self.parameters is not None else NO_PARAMETERS
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolPlan:
    family: Family
    functions: tuple[Function, ...]
    forced: bool  # required or named: the output is one constrained call
    parallel: bool
    response_format: ResponseFormat | None

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        return [f.template_form() for f in self.functions]

    @property
    def prompt_suffix(self) -> str:
        return self.family.forced_prefix if self.forced else ""

    @property
    def stops(self) -> tuple[str, ...]:
        return () if self.parallel or self.forced else self.family.single_call_stops

    def splitter(self) -> Splitter:
        inner = self.family.splitter(self.names, self.forced)
        if self.forced:
            inner = _CallsOnly(inner)
        return inner if self.parallel else _FirstCall(inner)


class _CallsOnly:
    """A forced call: the grammar writes nothing but the call, so any text is a call cut short; it is dropped, the
    same whole and streamed (a splitter only gives up a broken call as text at finish())."""

    def __init__(self, inner: Splitter) -> None:
        self.inner = inner

    def feed(self, text: str) -> list[Event]:
        return [e for e in self.inner.feed(text) if isinstance(e, Call)]

    def finish(self) -> list[Event]:
        return [e for e in self.inner.finish() if isinstance(e, Call)]


class _FirstCall:
    """parallel_tool_calls false: calls after the first are not returned (families stop the output there)."""

    def __init__(self, inner: Splitter) -> None:
        self.inner, self.seen = inner, False

    def _keep(self, events: list[Event]) -> list[Event]:
        out = []
        for e in events:
            if isinstance(e, Call):
                if self.seen:
                    continue
                self.seen = True
            out.append(e)
        return out

    def feed(self, text: str) -> list[Event]:
        return self._keep(self.inner.feed(text))

    def finish(self) -> list[Event]:
        return self._keep(self.inner.finish())


def plan_tools(template: str | None, functions: list[Function] | None, choice: str | None, parallel: bool,
               has_response_format: bool) -> ToolPlan | None:
    """The plan for a request's tools; None when nothing is to be parsed (no tools, or tool_choice none).
    choice: None (absent), "none", "auto", "required", or the name of a function. Raises InvalidRequest."""
    if not functions:
        if functions is not None:
            raise InvalidRequest("tools must hold at least one tool; leave it out for none", param="tools")
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools; send tools or leave tool_choice out", param="tool_choice")
        return None
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise InvalidRequest(f"tools: the function name {dup!r} is given twice", param="tools")
    family = family_of(template)
    if family is None:
        raise InvalidRequest("tools: this model's chat template has no tool-call format kvseal can parse "
                             "(kvseal parses Qwen2.5/Hermes <tool_call> and Llama 3.x JSON calls); serve a model "
                             "whose template has one, or pass one with --chat-template", param="tools")
    choice = choice or "auto"
    if choice == "none":
        return None
    if has_response_format:
        raise InvalidRequest("response_format cannot be combined with tools unless tool_choice is none",
                             param="response_format")
    if choice == "auto":
        return ToolPlan(family, tuple(functions), False, parallel, None)
    if choice != "required":
        if choice not in names:
            raise InvalidRequest(f"tool_choice names the function {choice!r}, which is not in tools",
                                 param="tool_choice")
        functions = [f for f in functions if f.name == choice]
    schemas = [family.call_schema(f.name, f.parameters if f.parameters is not None else NO_PARAMETERS)
               for f in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return ToolPlan(family, tuple(functions), True, parallel, response_format("json_schema", schema))

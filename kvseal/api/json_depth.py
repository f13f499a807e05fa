"""JSON inside a request (a call's `arguments` text, a tool's schema, a `tool_use` input) and JSON a model writes
as a call are read at most MAX_JSON_DEPTH levels deep; deeper is refused, never a RecursionError.

Python's json and jinja's `tojson` take one interpreter frame per level, so a value nested near the recursion
limit (about 1,000) parses in one place and fails in the next that walks it (the template, a call's schema, the
response store): a 500. With every value held to MAX_JSON_DEPTH at the door, each later walk adds a few levels
and stays far below that limit. The body itself is parsed by FastAPI, which already answers too deep a body with
a 400 ("There was an error parsing the body").
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

MAX_JSON_DEPTH = 128  # levels of arrays and objects, the outermost counted (serde_json's default limit)
TOO_DEEP = (f"JSON nested more than {MAX_JSON_DEPTH} levels deep; kvseal reads JSON up to {MAX_JSON_DEPTH} levels "
            f"of arrays and objects: flatten it")

T = TypeVar("T")


class TooDeep(ValueError):
    """JSON past MAX_JSON_DEPTH: a ValueError, as any text that is not JSON."""


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a decoded JSON value nests more than `limit` arrays and objects; walks level by level (no recursion,
    each container once)."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(limit):
        level = [c for x in level for c in (x.values() if isinstance(x, dict) else x) if isinstance(c, (dict, list))]
        if not level:
            return False
    return bool(level)


def bounded(value: T) -> T:
    """A pydantic AfterValidator: the value, or a ValueError naming the limit (a 400 naming the field)."""
    if too_deep(value):
        raise ValueError(TOO_DEEP)
    return value


def loads(text: str) -> Any:
    """json.loads, with JSON deeper than MAX_JSON_DEPTH a TooDeep."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(TOO_DEEP) from None
    if too_deep(value):
        raise TooDeep(TOO_DEEP)
    return value


def raw_decode(text: str, start: int) -> tuple[Any, int]:
    """json.JSONDecoder().raw_decode, with JSON deeper than MAX_JSON_DEPTH a TooDeep."""
    try:
        value, end = json.JSONDecoder().raw_decode(text, start)
    except RecursionError:
        raise TooDeep(TOO_DEEP) from None
    if too_deep(value):
        raise TooDeep(TOO_DEEP)
    return value, end

"""A process's role in the fleet, as it crosses the wire: one enum, never a bare string.

A StrEnum encodes as its value (msgspec: "prefill", "decode", "unified"), so the wire format is unchanged, and a
message naming any other role is refused when it is decoded.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    UNIFIED = "unified"  # one engine, both phases: never a fleet member

"""A worker's standing in the router's fleet, and the only place that moves it (seal 7 after start).

A worker gets requests only while SERVING, and it reaches SERVING only through CHECKING: the full fleet check
(router/registry.py) runs whenever a worker connects, reconnects, registers, or answers as a new process.

    CONNECTING -> CHECKING -> SERVING -> DRAINING -> LEFT
                           -> REFUSED                (failed the check: stays out, with the reason)
    any connected standing -> LOST                   (disconnected or silent: its requests failed)
    LOST | REFUSED | LEFT -> CHECKING                (it came back: checked again before any request)
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import assert_never

log = logging.getLogger("kvseal.router")


class Standing(enum.Enum):
    CONNECTING = "connecting"
    CHECKING = "checking"
    SERVING = "serving"
    REFUSED = "refused"
    DRAINING = "draining"
    LOST = "lost"
    LEFT = "left"


_MOVES: dict[Standing, frozenset[Standing]] = {
    Standing.CONNECTING: frozenset({Standing.CHECKING, Standing.LOST}),
    Standing.CHECKING: frozenset({Standing.SERVING, Standing.REFUSED, Standing.LOST, Standing.CHECKING}),
    Standing.SERVING: frozenset({Standing.DRAINING, Standing.LOST, Standing.CHECKING}),
    Standing.REFUSED: frozenset({Standing.CHECKING, Standing.LOST}),
    Standing.DRAINING: frozenset({Standing.LEFT, Standing.LOST, Standing.CHECKING}),
    Standing.LOST: frozenset({Standing.CHECKING}),
    Standing.LEFT: frozenset({Standing.CHECKING}),
}


class IllegalMove(RuntimeError):
    """An internal invariant broke: code tried a move between standings that does not exist."""


@dataclass
class Membership:
    """One worker's standing; only move() changes it. `reason` says why it is not SERVING (empty when it is)."""

    name: str
    standing: Standing = Standing.CONNECTING
    reason: str = ""
    since: float = field(default_factory=time.monotonic)
    refusals: int = 0  # times it failed the fleet check (metrics: kvseal:fleet_check_refusals_total)

    @property
    def serving(self) -> bool:
        return self.standing is Standing.SERVING

    @property
    def connected(self) -> bool:
        """The worker answers (its requests in flight continue), whether or not it gets new ones."""
        return self.standing in (Standing.CHECKING, Standing.SERVING, Standing.REFUSED, Standing.DRAINING)

    def move(self, to: Standing, reason: str = "") -> bool:
        """Move and log; False (no move) when already there. Raises IllegalMove for a move not in the table."""
        if to is self.standing and to is not Standing.CHECKING:
            return False
        if to not in _MOVES[self.standing]:
            raise IllegalMove(f"{self.name}: {self.standing.name} -> {to.name} is not a move")
        self.standing, self.reason, self.since = to, reason, time.monotonic()
        self.refusals += to is Standing.REFUSED
        level = {Standing.REFUSED: logging.ERROR, Standing.LOST: logging.ERROR, Standing.DRAINING: logging.WARNING,
                 Standing.LEFT: logging.WARNING}.get(to, logging.INFO)
        log.log(level, "%s: %s%s", self.name, describe(to), f": {reason}" if reason else "")
        return True


def describe(standing: Standing) -> str:
    """What a standing means to an operator. The match is exhaustive (mypy checks assert_never)."""
    match standing:
        case Standing.CONNECTING:
            return "connecting; no request until it answers and passes the fleet check"
        case Standing.CHECKING:
            return "connected; checking it against the fleet (seal 7) before it gets a request"
        case Standing.SERVING:
            return "passed the fleet check; in rotation"
        case Standing.REFUSED:
            return "refused: failed the fleet check and gets no request"
        case Standing.DRAINING:
            return "draining: finishing its requests, getting no new ones"
        case Standing.LOST:
            return "lost: disconnected or not answering; its requests failed"
        case Standing.LEFT:
            return "left the fleet after draining"
        case _:
            assert_never(standing)

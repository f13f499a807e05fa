"""Request states and the only place that moves them (seals 1 and 2).

A request is in exactly one `State`. Terminal states (FINISHED, REJECTED, ABORTED, FAILED) absorb: once a
request ends, nothing moves it again and its first outcome stands. Code never asks "is it done?" without
being able to ask "how did it end?": `Lifecycle.outcome` answers both, and `describe()` matches every
state exhaustively.

    RECEIVED -> ADMITTED -> RESERVED -> PREFILLING -> TRANSFERRING -> VERIFIED -> DECODING -> FINISHED
    any non-terminal state -> REJECTED | ABORTED | FAILED

The unified engine skips the handoff states (ADMITTED -> PREFILLING -> DECODING). A preempted request goes
back from PREFILLING/DECODING to ADMITTED (its pages freed, to be recomputed).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import assert_never

from kvseal.errors import KvsealError


class State(enum.Enum):
    RECEIVED = "received"
    ADMITTED = "admitted"
    RESERVED = "reserved"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    VERIFIED = "verified"
    DECODING = "decoding"
    FINISHED = "finished"
    REJECTED = "rejected"
    ABORTED = "aborted"
    FAILED = "failed"


TERMINAL = frozenset({State.FINISHED, State.REJECTED, State.ABORTED, State.FAILED})

# Forward moves only; the terminal moves (to REJECTED/ABORTED/FAILED) are allowed from any non-terminal
# state and handled by Lifecycle.end*, FINISHED only from DECODING.
_FORWARD: dict[State, frozenset[State]] = {
    State.RECEIVED: frozenset({State.ADMITTED}),
    State.ADMITTED: frozenset({State.RESERVED, State.PREFILLING}),
    State.RESERVED: frozenset({State.PREFILLING, State.TRANSFERRING}),
    State.PREFILLING: frozenset({State.TRANSFERRING, State.DECODING, State.ADMITTED}),
    State.TRANSFERRING: frozenset({State.VERIFIED}),
    State.VERIFIED: frozenset({State.DECODING}),
    State.DECODING: frozenset({State.ADMITTED}),
}


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"


class IllegalTransition(RuntimeError):
    """An internal invariant broke: code tried to move a request along an edge that does not exist."""


@dataclass(frozen=True)
class Outcome:
    """How a request ended. Exactly one of finish_reason (FINISHED) or error (the others) is set."""

    state: State
    finish_reason: FinishReason | None = None
    error: KvsealError | None = None

    def __post_init__(self) -> None:
        if self.state not in TERMINAL:
            raise IllegalTransition(f"{self.state} is not a terminal state")
        if (self.state is State.FINISHED) != (self.finish_reason is not None):
            raise IllegalTransition("FINISHED needs a finish_reason and only FINISHED has one")
        if (self.state is not State.FINISHED) != (self.error is not None):
            raise IllegalTransition(f"{self.state} needs its error and FINISHED has none")


@dataclass
class Lifecycle:
    """The state of one request. Only the methods below change it."""

    request_id: str
    state: State = State.RECEIVED
    outcome: Outcome | None = None
    history: list[tuple[State, float]] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def ended_from(self) -> State:
        """The state the request was in when it ended (its current state while it has not ended)."""
        if not self.terminal:
            return self.state
        return self.history[-2][0] if len(self.history) > 1 else State.RECEIVED

    def advance(self, to: State) -> None:
        """A forward move. Raises IllegalTransition for an edge that does not exist (incl. out of terminal)."""
        if to in TERMINAL:
            raise IllegalTransition(f"use finish/reject/abort/fail to end {self.request_id}, not advance({to})")
        if to not in _FORWARD.get(self.state, frozenset()):
            raise IllegalTransition(f"{self.request_id}: {self.state.name} -> {to.name} is not a transition")
        self._move(to)

    def finish(self, reason: FinishReason) -> bool:
        if self.terminal:
            return False
        if self.state is not State.DECODING:
            raise IllegalTransition(f"{self.request_id}: FINISHED from {self.state.name}; only from DECODING")
        return self._end(Outcome(State.FINISHED, finish_reason=reason))

    def reject(self, error: KvsealError) -> bool:
        return self._end(Outcome(State.REJECTED, error=error))

    def abort(self, cause: KvsealError) -> bool:
        return self._end(Outcome(State.ABORTED, error=cause))

    def fail(self, error: KvsealError) -> bool:
        return self._end(Outcome(State.FAILED, error=error))

    def _end(self, outcome: Outcome) -> bool:
        """End the request; a terminal request absorbs (returns False, keeps its first outcome)."""
        if self.terminal:
            return False
        self.outcome = outcome
        self._move(outcome.state)
        return True

    def _move(self, to: State) -> None:
        self.state = to
        self.history.append((to, time.monotonic()))


def describe(state: State) -> str:
    """What a state means to an operator. The match is exhaustive (mypy checks assert_never)."""
    match state:
        case State.RECEIVED:
            return "received by the server, not yet validated"
        case State.ADMITTED:
            return "validated and waiting for pages"
        case State.RESERVED:
            return "decode pages reserved, waiting for prefill"
        case State.PREFILLING:
            return "computing the prompt's KV"
        case State.TRANSFERRING:
            return "KV pages moving from prefill to decode"
        case State.VERIFIED:
            return "arrived KV verified against the reservation"
        case State.DECODING:
            return "generating tokens"
        case State.FINISHED:
            return "completed: stop or length"
        case State.REJECTED:
            return "refused before any KV moved, with its error"
        case State.ABORTED:
            return "cancelled (client disconnect or abort), pages freed"
        case State.FAILED:
            return "failed (fault, timeout, verification), pages freed"
        case _:
            assert_never(state)

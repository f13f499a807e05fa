"""The embed worker's queue: one FIFO of calls per tenant, and batches filled by virtual token counters.

Each tenant has a counter of the tokens it was served, divided by its weight. A batch is filled one input at a time
from the tenant whose counter is lowest, until the next input would pass the batch's token budget; a tenant that
arrives (or comes back) starts at the lowest counter of the tenants waiting, so no credit is saved while away.
So while two tenants wait, each gets its weight's share of every batch, and a tenant's flood delays another's
request by at most the batch in progress (docs/seals.md, seal 11).

Invariant: a call's inputs are taken in order, each exactly once; a call leaves the queue when its last input is
taken or when it is aborted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Call:
    """One embed request as the worker holds it."""

    peer: bytes  # the router connection it came from
    call_id: int
    tenant: str
    weight: float
    ids: list[list[int]]
    taken: int = 0  # inputs already put into a batch
    done: int = 0  # inputs embedded
    rows: list[bytes] = field(default_factory=list)  # each embedded input's float32 row, in order

    @property
    def key(self) -> tuple[bytes, int]:
        return (self.peer, self.call_id)


@dataclass(frozen=True)
class Piece:
    """Inputs [start, stop) of a call, in a batch."""

    call: Call
    start: int
    stop: int


class FairQueue:
    def __init__(self) -> None:
        self.waiting: dict[str, deque[Call]] = {}  # tenant -> its calls with inputs not yet taken, oldest first
        self.served: dict[str, float] = {}  # tenant -> tokens served / weight (tenants with calls waiting)

    def put(self, call: Call) -> None:
        if call.tenant not in self.waiting:
            self.waiting[call.tenant] = deque()
            self.served[call.tenant] = min(self.served.values(), default=0.0)  # no credit saved while away
        self.waiting[call.tenant].append(call)

    def abort(self, key: tuple[bytes, int]) -> Call | None:
        """Drop the call's inputs not yet taken (its inputs in a batch still run); the call, or None."""
        for tenant, calls in self.waiting.items():
            for call in calls:
                if call.key == key:
                    calls.remove(call)
                    if not calls:
                        del self.waiting[tenant], self.served[tenant]
                    return call
        return None

    @property
    def inputs(self) -> int:
        """Inputs waiting (not yet taken)."""
        return sum(len(c.ids) - c.taken for calls in self.waiting.values() for c in calls)

    def take(self, budget: int) -> list[Piece]:
        """A batch of at most `budget` tokens (always at least one input when any waits), fairly across tenants."""
        pieces: dict[tuple[bytes, int], Piece] = {}
        used = 0
        while self.waiting:
            tenant = min(self.waiting, key=lambda t: self.served[t])
            call = self.waiting[tenant][0]
            n = len(call.ids[call.taken])
            if pieces and used + n > budget:
                break
            old = pieces.get(call.key)
            pieces[call.key] = Piece(call, old.start if old else call.taken, call.taken + 1)
            call.taken += 1
            used += n
            self.served[tenant] += n / call.weight
            if call.taken == len(call.ids):
                self.waiting[tenant].popleft()
                if not self.waiting[tenant]:
                    del self.waiting[tenant], self.served[tenant]
        return list(pieces.values())

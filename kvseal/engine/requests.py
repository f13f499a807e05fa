"""A worker's one home for its requests, as vLLM's `Scheduler.requests`: each request is its Sequence, keyed by its
id, from the moment the worker received it until nothing of it is left here. Nothing else keeps a request: its
state is its Sequence's Lifecycle and the fields a role adds there (engine/sequence.py), so the questions a worker
asks (in flight? live? whose router? queued? quarantined?) each read this one book.

    queued       RECEIVED: a decode reservation waiting for pages (it holds none; engine/kv_reserve.py)
    live         not ended: in flight, `is_live`; an abort, a failure or a lost router ends it
    quarantined  ended while its KV was landing (decode, in place): out of flight, its pages still owned until the
                 landing is over; then it leaves
A request leaves when it ended and holds no page: at its end (Engine.end), or once its landing is over.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvseal.engine.sequence import Sequence
from kvseal.lifecycle import State


class Requests:
    def __init__(self) -> None:
        self._by_id: dict[str, Sequence] = {}  # in arrival order

    def add(self, seq: Sequence) -> None:
        assert seq.request_id not in self._by_id, seq.request_id  # Engine.receive refuses a request id in use
        self._by_id[seq.request_id] = seq

    def drop(self, seq: Sequence) -> None:
        if self._by_id.get(seq.request_id) is seq:
            del self._by_id[seq.request_id]

    def known(self, request_id: str) -> Sequence | None:
        """The request with this id, live or quarantined."""
        return self._by_id.get(request_id)

    def live(self, request_id: str) -> Sequence | None:
        seq = self._by_id.get(request_id)
        return None if seq is None or seq.life.terminal else seq

    def all(self) -> list[Sequence]:
        """Every request in the book: the live ones and the quarantined."""
        return list(self._by_id.values())

    def __iter__(self) -> Iterator[Sequence]:
        """The live requests, in arrival order (a list: ending one while iterating is safe)."""
        return iter([s for s in self._by_id.values() if not s.life.terminal])

    def __len__(self) -> int:
        return sum(1 for s in self._by_id.values() if not s.life.terminal)

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and self.live(request_id) is not None

    def here(self) -> list[Sequence]:
        """The live requests past the queue: running, waiting, reserved, landing, compiling (they hold pages, or
        will without asking again)."""
        return [s for s in self if s.life.state is not State.RECEIVED]

    def queued(self) -> list[Sequence]:
        """Reservations waiting for pages, oldest first."""
        return [s for s in self if s.life.state is State.RECEIVED]

    def quarantined(self) -> list[Sequence]:
        return [s for s in self._by_id.values() if s.life.terminal and s.landing]

    def routed_to(self, ident: bytes) -> list[Sequence]:
        """The live requests whose answers go to this router."""
        return [s for s in self if s.route is not None and s.route.ident == ident]

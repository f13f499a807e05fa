"""Ordered, bounded delivery from a worker's ROUTER socket to its routers: nothing is dropped silently.

ZeroMQ refuses a message when a peer's queue is at its high-water mark (the router fell behind). Such a message
waits here, and every later message to the same peer waits behind it, so a peer sees each message once and in
order. A peer that is gone (EHOSTUNREACH), whose oldest waiting message is older than `give_up_s`, or that has
more than `max_queued` waiting, is given up: its queue is dropped and `flush` returns it, so the worker fails that
peer's requests on its own side too (their pages freed). The router, for its part, sees the stream stop and ends
those requests FAILED (numbered deltas, a heartbeat, or its stall timeout), never with a 200.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import zmq

log = logging.getLogger("kvseal.worker")


class Outbox:
    def __init__(self, sock: zmq.Socket[bytes], give_up_s: float = 30.0, max_queued: int = 100_000) -> None:
        self.sock, self.give_up_s, self.max_queued = sock, give_up_s, max_queued
        self._waiting: dict[bytes, deque[tuple[float, bytes]]] = {}  # peer -> (queued at, message), in order
        self._lost: set[bytes] = set()  # given up since the last flush

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def send(self, ident: bytes, data: bytes) -> None:
        q = self._waiting.get(ident)
        if q is not None:  # earlier messages still wait: keep the order
            q.append((time.monotonic(), data))
            if len(q) > self.max_queued:
                self._give_up(ident, f"more than {self.max_queued} messages waiting")
            return
        if not self._try(ident, data):
            self._waiting.setdefault(ident, deque()).append((time.monotonic(), data))

    def flush(self) -> set[bytes]:
        """Send what waits, in order; returns the peers given up (now or by a send since the last flush)."""
        now = time.monotonic()
        for ident, q in list(self._waiting.items()):
            while q and ident in self._waiting and self._try(ident, q[0][1]):
                q.popleft()
            if ident not in self._waiting:  # given up while sending
                continue
            if not q:
                del self._waiting[ident]
            elif now - q[0][0] > self.give_up_s:
                self._give_up(ident, f"it read nothing for {self.give_up_s:g}s")
        lost, self._lost = self._lost, set()
        return lost

    def _try(self, ident: bytes, data: bytes) -> bool:
        """True when ZeroMQ took the message, or the peer is gone (then it is given up)."""
        try:
            self.sock.send_multipart([ident, data], flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer disconnected
            self._give_up(ident, f"it is gone ({exc})")
        return True

    def _give_up(self, ident: bytes, why: str) -> None:
        dropped = len(self._waiting.pop(ident, ()))
        if dropped:
            log.error("giving up on router %r: %s; %d message(s) dropped, its requests fail here", ident, why, dropped)
        else:  # a router that left with nothing waiting for it (one stopped on purpose): no loss, no error
            log.info("router %r left: %s; nothing was waiting for it", ident, why)
        self._lost.add(ident)

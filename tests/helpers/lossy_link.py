"""A lossy link between a router and a real decode worker: every control message passes through, except the
second delta of each request, which is dropped. It stands for what the issue found in the code: a worker that
sends with NOBLOCK and only logs when ZeroMQ refuses, so a router that falls behind loses output silently.

While a test sets `tamper`, that rule replaces the dropping one: it gets each message from decode (a plain dict)
and returns what to forward in its place (None: drop it), so a test can make decode say things a healthy worker
never says.

Frames are read as plain msgpack (no kvseal schema), so the link works against any kvseal version.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq


class LossyLink:
    def __init__(self, decode_endpoint: str) -> None:
        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.ROUTER)  # the router connects here as if to the decode worker
        self._front.setsockopt(zmq.LINGER, 0)
        self._front.bind("tcp://127.0.0.1:*")
        self.endpoint = self._front.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("tcp://")
        self._back = self._ctx.socket(zmq.DEALER)
        self._back.setsockopt(zmq.LINGER, 0)
        self._back.connect(f"tcp://{decode_endpoint}")
        self.dropped: list[str] = []  # request ids whose second delta was dropped
        self._seen: dict[str, int] = {}
        self._peer: bytes | None = None
        self.tamper: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        poller.register(self._back, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                if sock is self._front:
                    self._peer, data = self._front.recv_multipart()
                    self._back.send(data)
                else:
                    data = self._back.recv()
                    out = self._tampered(data) if self.tamper is not None else None if self._drop(data) else data
                    if out is not None and self._peer is not None:
                        self._front.send_multipart([self._peer, out])

    def _tampered(self, data: bytes) -> bytes | None:
        msg = msgspec.msgpack.decode(data)
        rule = self.tamper
        if not isinstance(msg, dict) or rule is None:
            return data
        out = rule(msg)
        return None if out is None else msgspec.msgpack.encode(out)

    def _drop(self, data: bytes) -> bool:
        msg = msgspec.msgpack.decode(data)
        if not isinstance(msg, dict) or msg.get("kind") != "delta":
            return False
        rid = msg["delta"]["request_id"]
        self._seen[rid] = self._seen.get(rid, 0) + 1
        if self._seen[rid] == 2:
            self.dropped.append(rid)
            return True
        return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._front.close(0)
        self._back.close(0)
        self._ctx.term()

"""ASGI middleware: request bodies over the limit get 413 before any handler parses them.

Common clients (httpx, the openai client, urllib, requests) send the whole body before they read a response. If
the server answered and closed while such a client was still sending, the client would see a connection reset,
not the 413. So the rest of an oversized body is read and dropped first (up to DRAIN_BYTES or DRAIN_SECONDS,
whichever ends first; past that the connection is closed, which only a client sending far more than the limit
sees), and the 413 carries `connection: close`.
"""

from __future__ import annotations

import asyncio
import json
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvseal.errors import PayloadTooLarge

DRAIN_BYTES = 256 * 2**20
DRAIN_SECONDS = 30.0


class _TooLarge(BaseException):  # BaseException: FastAPI turns Exceptions raised while reading a body into a 400
    pass


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _drain(receive)
            await self._reject(send)
            return
        seen = 0
        started = complete = False

        async def limited_receive() -> Message:
            nonlocal seen, complete
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                complete = not msg.get("more_body", False)
                if seen > self.max_bytes:
                    raise _TooLarge()
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                if not complete:  # the body went over on its last part: nothing is left to drain, and waiting
                    await _drain(receive)  # for more would hold the 413 back for DRAIN_SECONDS
                await self._reject(send)

    async def _reject(self, send: Send) -> None:
        err = PayloadTooLarge(f"request body larger than {self.max_bytes} bytes")
        data = json.dumps(err.to_openai()).encode()
        await send({"type": "http.response.start", "status": err.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": data})


async def _drain(receive: Receive) -> None:
    """Read and drop the rest of the request body, within DRAIN_BYTES and DRAIN_SECONDS."""
    seen, deadline = 0, time.monotonic() + DRAIN_SECONDS
    while seen < DRAIN_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            msg = await asyncio.wait_for(receive(), left)
        except TimeoutError:
            return
        if msg["type"] != "http.request":  # http.disconnect
            return
        seen += len(msg.get("body", b""))
        if not msg.get("more_body", False):
            return

"""ASGI middleware: request bodies over the limit get 413 before any handler parses them, and a tenant whose bodies
in the router (summed over its requests in progress) would pass its budget gets 429: one tenant cannot fill the
router's memory with bodies while the others wait (seal 11). It runs inside TenantAuth, so it knows the tenant;
a request's bytes count from its first byte until its response is over.

Common clients (httpx, the openai client, urllib, requests) send the whole body before they read a response. If
the server answered and closed while such a client was still sending, the client would see a connection reset,
not the 413. So the rest of an oversized body is read and dropped first (up to DRAIN_BYTES or DRAIN_SECONDS,
whichever ends first; past that the connection is closed, which only a client sending far more than the limit
sees), and the 413 carries `connection: close`.
"""

from __future__ import annotations

import asyncio
import time

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvseal.errors import KvsealError, PayloadTooLarge, RateLimited, http_reply

DRAIN_BYTES = 256 * 2**20
DRAIN_SECONDS = 30.0


class _Refused(BaseException):  # BaseException: FastAPI turns Exceptions raised while reading a body into a 400
    def __init__(self, err: KvsealError) -> None:
        self.err = err


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, tenant_bytes: int, held: dict[str, int]) -> None:
        self.app, self.max_bytes, self.tenant_bytes = app, max_bytes, tenant_bytes
        self.held = held  # tenant -> bytes of its bodies in requests in progress (absent: 0)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tenant = str(scope.get("state", {}).get("tenant", ""))
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit():
            err = self._too_large() if int(declared) > self.max_bytes else self._over_budget(tenant, int(declared))
            if err is not None:
                await _drain(receive)
                await _reject(err, scope, receive, send)
                return
        seen = 0
        started = complete = False

        async def limited_receive() -> Message:
            nonlocal seen, complete
            msg = await receive()
            if msg["type"] == "http.request":
                n = len(msg.get("body", b""))
                seen += n
                self.held[tenant] = self.held.get(tenant, 0) + n
                complete = not msg.get("more_body", False)
                err = self._too_large() if seen > self.max_bytes else self._over_budget(tenant, 0)
                if err is not None:
                    raise _Refused(err)
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _Refused as refused:
            if not started:
                if not complete:  # the body went over on its last part: nothing is left to drain, and waiting
                    await _drain(receive)  # for more would hold the 413 back for DRAIN_SECONDS
                await _reject(refused.err, scope, receive, send)
        finally:
            left = self.held.get(tenant, 0) - seen
            if left > 0:
                self.held[tenant] = left
            else:
                self.held.pop(tenant, None)

    def _too_large(self) -> KvsealError:
        return PayloadTooLarge(f"request body larger than {self.max_bytes} bytes")

    def _over_budget(self, tenant: str, more: int) -> KvsealError | None:
        """429 when this tenant's bodies in progress, plus `more` bytes, pass its budget."""
        held = self.held.get(tenant, 0)
        if held + more <= self.tenant_bytes:
            return None
        return RateLimited(f"Rate limit reached for request bodies in progress: this key's requests already hold "
                           f"{held} bytes of request bodies in the server, and its limit is {self.tenant_bytes}. "
                           f"Please try again when one of them has finished.", retry_after_s=1.0)


async def _reject(err: KvsealError, scope: Scope, receive: Receive, send: Send) -> None:
    status, body, headers = http_reply(err)
    # what is left of the body was drained, or is not worth reading
    await JSONResponse(body, status, {**(headers or {}), "connection": "close"})(scope, receive, send)


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

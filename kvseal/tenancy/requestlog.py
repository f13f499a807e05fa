"""ASGI middleware, outermost: every response carries X-Request-Id, and every request that did not complete is
logged once, in one line: request id, tenant, status, error code, reason, and the state and worker where it ended.

"Did not complete" is any status but 200, and a 200 stream that ended with an error event. The handlers fill
the request's `Trace` (for errors, the stage and worker the backend reported; the tenant comes from TenantAuth,
tenancy/tenants.py, and is a name, never a key); the code and reason of
an error response are read from its OpenAI-shaped body, so responses sent by other middleware (413) are logged
too. An exception that escapes every handler is answered here with a 500 in the same shape.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("kvseal.requests")
HEADER = b"x-request-id"
_MAX_BODY = 65536  # of an error response, read for its code and message


@dataclass
class Trace:
    request_id: str
    status: int = 0
    code: str | None = None
    reason: str | None = None
    stage: str | None = None  # the request's state when it ended (lifecycle), "received" before any worker
    worker: str | None = None
    stream_error: bool = False  # a 200 stream that ended with an error event

    def failed(self, code: str | None, reason: str, stage: str | None, worker: str | None) -> None:
        self.code, self.reason, self.stage, self.worker = code, reason, stage, worker


def trace_of(scope: Scope) -> Trace:
    """The request's Trace (set by RequestLog; a fresh one where the middleware is absent, as in unit tests)."""
    state = scope.setdefault("state", {})
    trace = state.get("trace")
    if not isinstance(trace, Trace):
        trace = state["trace"] = Trace(uuid.uuid4().hex)
    return trace


class RequestLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        trace = trace_of(scope)
        body = bytearray()
        started = False

        async def tagged_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
                trace.status = int(msg["status"])
                msg = {**msg, "headers": [*msg.get("headers", []), (HEADER, trace.request_id.encode())]}
            elif msg["type"] == "http.response.body" and trace.status != 200 and len(body) < _MAX_BODY:
                body.extend(msg.get("body", b"")[: _MAX_BODY - len(body)])
            await send(msg)

        try:
            await self.app(scope, receive, tagged_send)
        except Exception:
            log.exception("request %s: unhandled error", trace.request_id)
            if started:
                raise
            trace.failed("internal_error", "internal error; the request was not completed", trace.stage, None)
            await _send_500(tagged_send)
        if trace.status != 200 or trace.stream_error:
            _log_once(scope, trace, bytes(body))


def _log_once(scope: Scope, trace: Trace, body: bytes) -> None:
    if trace.code is None and trace.reason is None:
        try:
            err = json.loads(body)["error"]
            trace.code, trace.reason = err.get("code"), err.get("message")
        except (ValueError, KeyError, TypeError):
            trace.reason = body[:200].decode(errors="replace") or None
    level = logging.ERROR if trace.status >= 500 or trace.stream_error else logging.WARNING
    tenant = scope.get("state", {}).get("tenant") or "-"  # set by TenantAuth once the key is known
    log.log(level, "request %s %s %s tenant=%s status=%d%s code=%s stage=%s worker=%s: %s", trace.request_id,
            scope.get("method", "?"), scope.get("path", "?"), tenant, trace.status,
            " (stream ended with an error)" if trace.stream_error else "", trace.code or "-",
            trace.stage or "received", trace.worker or "-", trace.reason or "-")


async def _send_500(send: Send) -> None:
    data = json.dumps({"error": {"message": "internal error; the request was not completed",
                                 "type": "server_error", "param": None, "code": "internal_error"}}).encode()
    headers: list[Any] = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": 500, "headers": headers})
    await send({"type": "http.response.body", "body": data})

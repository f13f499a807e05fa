"""ASGI middleware, inside TenantAuth: each completion request is admitted against its tenant's limits
(router/limits.py) before its body is read, and every answer to it carries the tenant's x-ratelimit-* headers.

Over max_concurrent or rpm: 429 here, and nothing further runs. Over tpm: the route (routes/generate.py) charges
the tokens once the prompt is tokenized and raises RateLimited, before any worker sees the request. The lease is
released exactly once, when the response is over, whatever its outcome (the client left, a worker failed)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvseal.errors import RateLimited
from kvseal.router.http_errors import error_response
from kvseal.router.limits import RateLimiter
from kvseal.router.tenantview import GENERATE_PATHS


class RateLimits:
    def __init__(self, app: ASGIApp, limiter: RateLimiter) -> None:
        self.app, self.limiter = app, limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in GENERATE_PATHS or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        tenant = str(state.get("tenant", ""))

        async def with_headers(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                extra = [(k.encode(), v.encode()) for k, v in self.limiter.headers(tenant)]
                msg = {**msg, "headers": [*msg.get("headers", []), *extra]}
            await send(msg)

        try:
            lease = self.limiter.admit(tenant)
        except RateLimited as err:
            await error_response(err)(scope, receive, with_headers)
            return
        state["rate_lease"] = lease
        try:
            await self.app(scope, receive, with_headers)
        finally:
            self.limiter.release(lease)

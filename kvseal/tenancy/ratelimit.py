"""ASGI middleware, inside TenantAuth: every request that does work (any path but the few that only read what the
server is: STATUS_PATHS) is admitted against its tenant's max_concurrent and rpm (tenancy/limits.py) before its body
is read, and every answer to it carries the tenant's x-ratelimit-* headers. /tokenize, /detokenize,
count_tokens and stored-response lookups count as requests exactly as completions do: a tenant at its limit cannot
go on using the router's threads through them (seal 11).

Over max_concurrent or rpm: 429 here, and nothing further runs. Over tpm: the route (routes/generate.py) charges
the tokens once the prompt is tokenized and raises RateLimited, before any worker sees the request. The lease is
released exactly once, when the response is over, whatever its outcome (the client left, a worker failed)."""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvseal.errors import RateLimited, StateUnavailable, http_reply
from kvseal.tenancy.limits import Lease
from kvseal.tenancy.state import Limits

# what the server is and whether it is up: read-only, cheap, needed by health checks and clients' start-up
STATUS_PATHS = frozenset({"/health", "/info", "/v1/models", "/version", "/metrics"})


class RateLimits:
    def __init__(self, app: ASGIApp, limiter: Limits) -> None:
        self.app, self.limiter = app, limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in STATUS_PATHS:
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        tenant = str(state.get("tenant", ""))

        async def with_headers(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                extra = [(k.encode(), v.encode()) for k, v in await self.limiter.headers(tenant, lease)]
                msg = {**msg, "headers": [*msg.get("headers", []), *extra]}
            await send(msg)

        lease: Lease | None = None
        try:
            lease = await self.limiter.admit(tenant)
        except (RateLimited, StateUnavailable) as err:  # StateUnavailable: the shared state is down, fail closed
            status, body, headers = http_reply(err)
            await JSONResponse(body, status, headers)(scope, receive, with_headers)
            return
        state["rate_lease"] = lease
        try:
            await self.app(scope, receive, with_headers)
        finally:
            await self.limiter.release(lease)

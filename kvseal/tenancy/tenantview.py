"""Tenants see only their own world: the fleet's internals (workers, endpoints, the fleet socket, every tenant's
load) go only to admin keys; a tenant's /info holds what a client needs and its own figures.

`request.state.admin` is set by TenantAuth (tenancy/tenants.py): true for a key marked `admin` in --api-keys, and
for everyone on a server without keys (one tenant: it says so at start). TenantFigures counts each tenant's own
completion requests (in flight, completed, failed) for its /info.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvseal.errors import PermissionDenied
from kvseal.tenancy.requestlog import trace_of

GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"})
Figures = defaultdict[str, dict[str, int]]  # tenant -> {"in_flight", "completed", "failed"}


def new_figures() -> Figures:
    return defaultdict(lambda: {"in_flight": 0, "completed": 0, "failed": 0})


def is_admin(request: Request) -> bool:
    return bool(getattr(request.state, "admin", False))


def require_admin(request: Request, what: str) -> None:
    if not is_admin(request):
        raise PermissionDenied(f"{what} shows the whole fleet and is for admin keys only; this key's own figures "
                               f"are in /info. An operator marks a key `admin` in the --api-keys file")


class TenantFigures:
    """ASGI middleware, inside TenantAuth: per tenant, completion requests in flight, completed and failed."""

    def __init__(self, app: ASGIApp, figures: Figures) -> None:
        self.app, self.figures = app, figures

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in GENERATE_PATHS:
            await self.app(scope, receive, send)
            return
        mine = self.figures[str(scope.setdefault("state", {}).get("tenant", ""))]
        mine["in_flight"] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            mine["in_flight"] -= 1
            trace = trace_of(scope)
            mine["completed" if trace.status == 200 and not trace.stream_error else "failed"] += 1


def tenant_info(request: Request, model: str, context_window: int) -> dict[str, Any]:
    """What a tenant's /info shows: the model, the served window and its own requests; nothing of the fleet."""
    tenant = str(getattr(request.state, "tenant", ""))
    figures: Figures | None = getattr(request.app.state, "tenant_figures", None)
    mine = figures.get(tenant) if figures is not None else None
    return {"model": model, "context_window": context_window, "tenant": tenant,
            "requests": dict(mine or {"in_flight": 0, "completed": 0, "failed": 0})}

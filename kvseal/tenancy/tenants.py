"""Tenants from API keys: `--api-keys FILE` and the HTTP middleware that turns a bearer key into a tenant.

The file has one line per key, `TENANT KEY`, and `#` comments (tenancy/tenant_file.py: settings per tenant such
as `weight=3 rpm=600` may follow); `TENANT KEY admin` makes that key an admin key too: only admin keys see the
fleet's internals (/info's workers and endpoints, /metrics, /doctor/probe; tenancy/tenantview.py). Keys are kept
only as SHA-256 digests from the moment the file is read, and no message, log line or /info field ever holds a
key (or a line of the file). Without the flag there is one tenant, "", no key
is asked for, and every client sees everything (the server says so at start). The tenant travels with each
request to every worker; prefix caches are keyed by it (seal 9).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from kvseal.tenancy.tenant_file import key_digest, read_tenants_file

__all__ = ["OPEN_PATHS", "TenantAuth", "key_digest", "load_api_keys", "read_key_file"]

OPEN_PATHS = frozenset({"/health"})  # the only route that needs no key


def load_api_keys(path: str) -> tuple[tuple[str, str], ...]:
    """(key digest, tenant) for each key in the file. Errors name the file and line, never its content."""
    return read_tenants_file(path).keys


def read_key_file(path: str) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """((key digest, tenant) per key, digests of the admin keys)."""
    f = read_tenants_file(path)
    return f.keys, f.admins


class TenantAuth:
    """ASGI middleware: every route but /health needs `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`)
    naming a known key; the
    tenant goes into request.state.tenant, and whether it is an admin key into request.state.admin (every
    client is admin on a server without keys). A missing or unknown key gets 401 in OpenAI's error shape."""

    def __init__(self, app: ASGIApp, api_keys: tuple[tuple[str, str], ...], admin_keys: tuple[str, ...] = ()) -> None:
        self.app = app
        self.tenants = dict(api_keys)
        self.admins = frozenset(admin_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tenant, admin = "", not self.tenants
        if self.tenants and scope["path"] not in OPEN_PATHS:
            headers = dict(scope.get("headers") or [])
            scheme, _, key = headers.get(b"authorization", b"").decode("latin-1").strip().partition(" ")
            if scheme.lower() != "bearer" or not key.strip():  # Anthropic's clients send x-api-key instead
                scheme, key = "bearer", headers.get(b"x-api-key", b"").decode("latin-1")
            if not key.strip():
                await _unauthorized(send, "You didn't provide an API key. Send it in an Authorization header "
                                          "using Bearer auth (Authorization: Bearer YOUR_KEY) or in x-api-key.")
                return
            found = self.tenants.get(key_digest(key.strip()))
            if found is None:
                await _unauthorized(send, "Incorrect API key provided. Use a key from the server's --api-keys "
                                          "file.")
                return
            tenant, admin = found, key_digest(key.strip()) in self.admins
        scope.setdefault("state", {}).update(tenant=tenant, admin=admin)
        await self.app(scope, receive, send)


async def _unauthorized(send: Send, message: str) -> None:
    body: dict[str, Any] = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                      "code": "invalid_api_key"}}
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": data})

"""Errors on the Anthropic routes (/v1/messages...) in Anthropic's shape: {"type": "error", "error": {"type",
"message"}}, with the same status. One ASGI middleware rewrites every error body on those paths, whichever part
of the server wrote it (keys 401, body limit 413, validation 400, a worker's error), so there is one mapping."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PREFIX = "/v1/messages"
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
          529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def from_openai(status: int, body: bytes) -> bytes:
    """An OpenAI-shaped error body as Anthropic's; a body that is not one is carried as the message."""
    try:
        message = str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")
    return json.dumps(anthropic_error(status, message), ensure_ascii=False).encode()


class AnthropicErrors:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = bytearray()

        async def rewriting_send(msg: Message) -> None:
            nonlocal start
            if msg["type"] == "http.response.start" and msg["status"] >= 400:
                start = msg  # held until the body is whole
                return
            if start is None:
                await send(msg)
                return
            body.extend(msg.get("body", b""))
            if msg.get("more_body", False):
                return
            data = from_openai(start["status"], bytes(body))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length",
                                                                                        b"content-type")]
            await send({**start, "headers": [*headers, (b"content-type", b"application/json"),
                                             (b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data})

        await self.app(scope, receive, rewriting_send)

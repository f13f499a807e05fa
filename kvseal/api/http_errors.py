"""Every failure leaves the HTTP API here, as OpenAI-shaped JSON with its status (a 503 with Retry-After)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvseal.errors import InvalidRequest, KvsealError, NotFound, http_reply
from kvseal.tenancy.requestlog import trace_of
from kvseal.wire.messages import GenerateDelta


def error_response(err: KvsealError) -> JSONResponse:
    status, body, headers = http_reply(err)
    return JSONResponse(body, status_code=status, headers=headers)


def failed(request: Request, err: KvsealError, last: GenerateDelta | None = None) -> JSONResponse:
    """The error response for a request that reached the backend, its stage and worker noted for the log."""
    trace_of(request.scope).failed(err.code, err.message, last.stage if last else None,
                                   last.worker if last else None)
    return error_response(err)


def validation_error(errs: Sequence[Any]) -> InvalidRequest:
    """The first pydantic error as a 400 naming the field (an unknown field: `extra_forbidden`). A value that failed
    every branch of a union fails each: a `value_error` (kvseal's own validators, whose messages name the limit) is
    the one told, and the branches' labels (`list[...]`, `literal[...]`: never a field) are left out of the name."""
    first = next((e for e in errs if e.get("type") == "value_error"), errs[0] if errs else {})
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body" and "[" not in str(x))
    if first.get("type") == "extra_forbidden":
        return InvalidRequest(f"{loc}: this field is not supported by kvseal; remove it from the request",
                              param=loc or None)
    msg = f"{loc}: {first.get('msg', 'invalid request')}" if loc else str(first.get("msg", "invalid"))
    return InvalidRequest(msg, param=loc or None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KvsealError)
    async def _kvseal_error(_: Request, err: KvsealError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(NotFound("no such endpoint"))
        err = InvalidRequest(str(exc.detail))
        err.status = exc.status_code
        return error_response(err)

"""Typed errors at kvseal's boundaries, each mapped once to an OpenAI-shaped HTTP error.

Every error carries the HTTP status, OpenAI's error `type` and `code`, and a message that says what was
wrong and how to fix it. Errors travel between processes as `ErrorInfo` (see to_info/from_info) so the
client always gets the *original* error (seal 3), never a re-worded or generic one.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec


class ErrorInfo(msgspec.Struct, frozen=True):
    """An error as it crosses a process boundary; rebuilt into the same KvsealError class on arrival."""

    kind: str  # the KvsealError subclass name
    message: str
    status: int
    type: str
    code: str | None = None
    param: str | None = None


PEER_BAD_STATUS = 502  # an error from a peer whose status is not an HTTP error status (a 200): the peer is at fault
OWN_BAD_STATUS = 500  # the same from this process's own code
RETRY_AFTER_S = 1  # what a 503 (overloaded, queue full, no worker serving) tells the client to wait


def http_error_status(status: int, fallback: int) -> int:
    """`status` when it is an HTTP error status (400-599), else `fallback`: any error maps to a non-2xx."""
    return status if 400 <= status <= 599 else fallback


class KvsealError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_openai(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_info(self) -> ErrorInfo:
        return ErrorInfo(type(self).__name__, self.message, self.status, self.type, self.code, self.param)

    @staticmethod
    def from_info(info: ErrorInfo) -> KvsealError:
        cls = _REGISTRY.get(info.kind, KvsealError)
        err = cls(info.message, param=info.param, code=info.code)
        # Keep the original status/type even for an unknown kind from a newer peer; but an error is never a
        # success: a peer that sends one with a status outside 400-599 is itself at fault (502).
        err.status, err.type = http_error_status(info.status, PEER_BAD_STATUS), info.type
        return err

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class InvalidRequest(KvsealError):
    status, type = 400, "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class ModelNotFound(KvsealError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class NotFound(KvsealError):
    status, type, code = 404, "invalid_request_error", "not_found"


class PayloadTooLarge(KvsealError):
    status, type, code = 413, "invalid_request_error", "payload_too_large"


class Overloaded(KvsealError):
    status, type, code = 503, "server_error", "overloaded"


class StateUnavailable(Overloaded):
    """The shared tenant state (--state redis://...) cannot be reached: limits fail closed, stored responses are not
    served, and the client is told to retry (503 with Retry-After), never served unlimited or another's data."""

    code = "state_unavailable"


class NoWorkerAvailable(Overloaded):
    """No worker of a role is serving: none configured is up, or every one failed the fleet check (seal 7)."""

    code = "no_worker"


class WorkerDraining(Overloaded):
    """The worker is draining (SIGTERM or `kvseal drain`): it finishes what it has and takes nothing new."""

    code = "worker_draining"


class RequestAborted(KvsealError):
    """The request was aborted (client disconnect, shutdown, explicit abort)."""

    status, type, code = 499, "aborted", "request_aborted"


class WorkerFailed(KvsealError):
    """A worker died, timed out or answered something it should not have."""

    status, type, code = 502, "server_error", "worker_failed"


class StreamBroken(WorkerFailed):
    """A request's output arrived with a hole (a delta lost, repeated or out of order): the answer is incomplete."""

    code = "stream_incomplete"


class TransferTimeout(WorkerFailed):
    status, code = 504, "transfer_timeout"


class TransferVerificationFailed(KvsealError):
    """Arrived KV does not match its reservation (seal 4); the request produces no output."""

    status, type, code = 502, "server_error", "kv_verification_failed"
    field = "unknown"  # the manifest field that failed (on the decode worker only; metrics and the ledger)


class PageOwnershipViolation(KvsealError):
    """A page table names a page the request does not own (seal 5); the request produces no output."""

    status, type, code = 500, "server_error", "kv_ownership_violation"


class CapacityMismatch(KvsealError):
    """A worker cannot hold the served context window, or workers disagree on layout (seal 7)."""

    status, type, code = 500, "server_error", "capacity_mismatch"


class PermissionDenied(KvsealError):
    """An API key that may not see this (the fleet's internals are for admin keys)."""

    status, type, code = 403, "invalid_request_error", "permission_denied"


class InternalError(KvsealError):
    status, type, code = 500, "server_error", "internal_error"


class RateLimited(KvsealError):
    """A tenant over one of its limits (tenancy/limits.py): 429 in OpenAI's shape, `type` "requests" or "tokens".

    retry_after_s: when the same request would be admitted (None: never, it is larger than the limit itself)."""

    status, type, code = 429, "requests", "rate_limit_exceeded"

    def __init__(self, message: str, *, kind: str = "requests", retry_after_s: float | None = 1.0,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)
        self.type = kind
        self.retry_after_s = retry_after_s


def http_reply(err: KvsealError) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    """An error as it leaves over HTTP: its status (never a 2xx/3xx), its OpenAI-shaped body, and its headers: a 503
    says when to retry, a 429 when the same request would pass (as OpenAI's clients read it), or that it never will."""
    status = http_error_status(err.status, OWN_BAD_STATUS)
    headers = {"retry-after": str(RETRY_AFTER_S)} if status == 503 else None
    if isinstance(err, RateLimited):
        wait = err.retry_after_s
        headers = ({"x-should-retry": "false"} if wait is None else
                   {"retry-after": str(max(1, math.ceil(wait))), "retry-after-ms": str(max(1, math.ceil(wait * 1000)))})
    return status, err.to_openai(), headers


def _subclasses(cls: type[KvsealError]) -> list[type[KvsealError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_subclasses(sub))
    return out


# Read-only lookup table built once at import; never mutated afterwards.
_REGISTRY: dict[str, type[KvsealError]] = {c.__name__: c for c in _subclasses(KvsealError)}

"""Typed control messages between the router and the workers (msgpack over ZeroMQ; never pickled).

Every message carries `v`; a peer refuses a version it does not know. Calls carry a call_id that the
answer repeats; DeltaMsg and the release/abort notices are one-way.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvseal.engine.messages import SCHEMA_VERSION, GenerateDelta, GenerateRequest
from kvseal.errors import ErrorInfo
from kvseal.transfer.manifest import Reservation


class _Msg(msgspec.Struct, frozen=True, tag_field="kind", kw_only=True):
    v: int = SCHEMA_VERSION


class InfoReq(_Msg, tag="info_req", frozen=True, kw_only=True):
    call_id: int


class InfoResp(_Msg, tag="info", frozen=True, kw_only=True):
    call_id: int
    info: dict[str, Any]


class ReserveReq(_Msg, tag="reserve", frozen=True, kw_only=True):
    """router -> decode: set pages aside for this prompt."""

    call_id: int
    request: GenerateRequest


class ReserveResp(_Msg, tag="reserved", frozen=True, kw_only=True):
    call_id: int
    reservation: Reservation | None = None
    error: ErrorInfo | None = None


class PrefillReq(_Msg, tag="prefill", frozen=True, kw_only=True):
    """router -> prefill: compute the prompt's KV and hand it to the reservation's decode worker."""

    call_id: int
    request: GenerateRequest
    reservation: Reservation


class PrefillResp(_Msg, tag="prefilled", frozen=True, kw_only=True):
    """prefill -> router, when its part ends: error None means decode acknowledged the KV.

    `state` is the prefill side's ending: "handed_off", or "rejected" (refused before any KV moved),
    "failed" or "aborted"."""

    call_id: int
    request_id: str
    state: str
    error: ErrorInfo | None = None
    kv_bytes_sent: int = 0
    cached_tokens: int = 0  # prompt tokens this worker took from its prefix cache (usage.prompt_tokens_details)


class ReleaseReq(_Msg, tag="release", frozen=True, kw_only=True):
    """router -> decode: end this reservation with `error` (rejected: nothing was ever sent for it)."""

    request_id: str
    error: ErrorInfo
    rejected: bool


class HandoffStarted(_Msg, tag="handoff_started", frozen=True, kw_only=True):
    """prefill -> router: this request's prefill is done and its KV is being handed to decode. From here on the
    transfer must complete within decode's reservation timeout: the router stops renewing the reservation."""

    request_id: str


class RenewReq(_Msg, tag="renew", frozen=True, kw_only=True):
    """router -> decode: this reservation's prefill is still queued or running (both ends alive); push its
    deadline out. Renewals stop when the router is gone, and the reservation then expires and frees its pages."""

    request_id: str


class AbortReq(_Msg, tag="abort", frozen=True, kw_only=True):
    """router -> any worker: the client is gone or the request failed elsewhere; free its pages now."""

    request_id: str
    error: ErrorInfo


class SetFaultsReq(_Msg, tag="set_faults", frozen=True, kw_only=True):
    """Test-only: replace a worker's injected faults. Refused unless KVSEAL_TEST_FAULTS includes "control"."""

    call_id: int
    spec: str  # the same syntax as the environment variable, "" for none


class DeltaMsg(_Msg, tag="delta", frozen=True, kw_only=True):
    """decode -> router: new output of a request (after its KV was verified)."""

    delta: GenerateDelta


Message = (InfoReq | InfoResp | ReserveReq | ReserveResp | PrefillReq | PrefillResp | ReleaseReq | RenewReq
           | HandoffStarted | AbortReq | SetFaultsReq | DeltaMsg)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Raises msgspec.ValidationError / DecodeError for a malformed or unknown message."""
    msg = _decoder.decode(data)
    if msg.v != SCHEMA_VERSION:
        raise msgspec.ValidationError(f"message schema v{msg.v} is not v{SCHEMA_VERSION}")
    return msg

"""Typed control messages between the router and the workers (msgpack over ZeroMQ; never pickled).

Every message carries `v`; a peer refuses a version it does not know. Calls carry a call_id that the
answer repeats; DeltaMsg and the release/abort notices are one-way.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvseal.errors import ErrorInfo
from kvseal.wire.card import WorkerCard
from kvseal.wire.messages import SCHEMA_VERSION, GenerateDelta, GenerateRequest
from kvseal.wire.reservation import Reservation
from kvseal.wire.roles import Role

# the environment variable `kvseal serve` (kvseal/launch.py) sets on the workers it starts: its own pid. A worker
# whose launcher is gone exits (worker/server.py), so a killed `kvseal serve` leaves no worker behind
LAUNCHER_PID_ENV = "KVSEAL_LAUNCHER_PID"


class _Msg(msgspec.Struct, frozen=True, tag_field="kind", kw_only=True):
    v: int = SCHEMA_VERSION


class InfoReq(_Msg, tag="info_req", frozen=True, kw_only=True):
    call_id: int


class InfoResp(_Msg, tag="info", frozen=True, kw_only=True):
    """worker -> router: what the worker is (its card: every field the fleet check compares, typed; one missing
    is a decode error), whether it is draining (the router stops sending it requests), and its figures.

    `figures` are what the worker shows beside its card in /info: where it listens, counters and live figures
    (free pages, requests, tenants, transport state) that change every step. No check and no routing decision
    reads them (kvseal doctor and tests display and compare them), so they stay a plain map: a new counter is one
    line in the worker, not a schema change for every peer."""

    call_id: int
    card: WorkerCard
    draining: bool
    figures: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """The worker's /info: figures, then draining and the card's fields (so no figure can hide a card field)."""
        return {**self.figures, "draining": self.draining, **self.card.to_json()}


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


class StatusReq(_Msg, tag="status", frozen=True, kw_only=True):
    """router -> worker: is this request still live here? Asked when a request's output is overdue, so that a
    request that waits (queued, preempted) is not mistaken for one whose final delta was lost."""

    call_id: int
    request_id: str


class StatusResp(_Msg, tag="status_is", frozen=True, kw_only=True):
    call_id: int
    live: bool  # the worker still holds the request (queued, reserved, running or waiting)
    sent: int  # deltas sent for it so far (decode), numbered 0 .. sent - 1


class DrainReq(_Msg, tag="drain", frozen=True, kw_only=True):
    """operator (`kvseal drain`) -> worker: take no new request, finish those in flight, then exit."""

    call_id: int


class DrainResp(_Msg, tag="draining", frozen=True, kw_only=True):
    call_id: int
    inflight: int  # requests still to finish before the worker exits


class DrainNotice(_Msg, tag="drain_notice", frozen=True, kw_only=True):
    """worker -> every router it serves, once, when it starts draining: send it nothing new."""


class JoinReq(_Msg, tag="join", frozen=True, kw_only=True):
    """worker (`--router`) -> the router's fleet socket: check me (seal 7) and put me in rotation."""

    call_id: int
    role: Role
    endpoint: str  # the worker's control endpoint, as the router should connect to it


class JoinResp(_Msg, tag="joined", frozen=True, kw_only=True):
    call_id: int
    accepted: bool
    reason: str = ""  # why it was refused: the fleet check's message, with both numbers and both fixes
    context_window: int = 0


class DeltaMsg(_Msg, tag="delta", frozen=True, kw_only=True):
    """decode -> router: new output of a request (after its KV was verified).

    `seq` numbers a request's deltas 0, 1, 2, ...; the router checks that each is the next one, so a lost,
    repeated or reordered delta ends the request FAILED instead of answering with text missing."""

    delta: GenerateDelta
    seq: int


Message = (InfoReq | InfoResp | ReserveReq | ReserveResp | PrefillReq | PrefillResp | ReleaseReq | RenewReq
           | HandoffStarted | AbortReq | StatusReq | StatusResp | DrainReq | DrainResp | DrainNotice | JoinReq
           | JoinResp | DeltaMsg)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


class _CallId(msgspec.Struct):
    call_id: int | None = None


def call_id_of(data: bytes) -> int | None:
    """The call id in a frame that did not decode (a peer of another kvseal version, e.g. a card missing a field),
    so that its call fails at once with the reason instead of timing out; None when there is none to read."""
    try:
        return msgspec.msgpack.decode(data, type=_CallId).call_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def decode(data: bytes) -> Message:
    """Raises msgspec.ValidationError / DecodeError for a malformed or unknown message."""
    msg = _decoder.decode(data)
    if msg.v != SCHEMA_VERSION:
        raise msgspec.ValidationError(f"message schema v{msg.v} is not v{SCHEMA_VERSION}")
    return msg

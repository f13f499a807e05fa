"""Typed messages between the router and its embed worker (msgpack over ZeroMQ; never pickled).

A call carries a call_id that its answer repeats. The router says hello first and checks the answer against the
model it serves; an embed request names its tenant and weight (from the tenants file, never from the client) and
carries token ids only: the router tokenizes, the worker never sees text. An abort is one-way: the client left,
the worker drops what of that call is still queued.
"""

from __future__ import annotations

import msgspec

from kvseal.errors import ErrorInfo

WIRE_VERSION = 1


class _Msg(msgspec.Struct, frozen=True, tag_field="kind", kw_only=True):
    v: int = WIRE_VERSION


class Hello(_Msg, tag="hello", frozen=True, kw_only=True):
    """router -> worker: what are you? (also the heartbeat)"""

    call_id: int


class Card(_Msg, tag="card", frozen=True, kw_only=True):
    """worker -> router: the model it embeds with; the router refuses to start with a worker that differs from the
    folder it tokenizes with."""

    call_id: int
    model: str
    dim: int
    max_tokens: int
    pooling: str
    normalize: bool
    queued_inputs: int  # inputs waiting in the worker's fair queue now


class EmbedReq(_Msg, tag="embed", frozen=True, kw_only=True):
    call_id: int
    tenant: str
    weight: float
    ids: list[list[int]]  # one token list per input, each 1..max_tokens long


class EmbedResp(_Msg, tag="embedded", frozen=True, kw_only=True):
    call_id: int
    data: bytes = b""  # float32 little-endian, (inputs, dim) row-major
    error: ErrorInfo | None = None


class Abort(_Msg, tag="abort", frozen=True, kw_only=True):
    call_id: int


Message = Hello | Card | EmbedReq | EmbedResp | Abort
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Raises msgspec.ValidationError / DecodeError for a malformed or unknown message."""
    msg = _decoder.decode(data)
    if msg.v != WIRE_VERSION:
        raise msgspec.ValidationError(f"embed message v{msg.v} is not v{WIRE_VERSION}")
    return msg

"""The worker card and the KV spec on the wire: typed, every field required, /info's keys unchanged."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvseal.router.membership import Standing
from kvseal.router.workers import WorkerClient
from kvseal.wire import protocol as P
from kvseal.wire.card import WorkerCard
from kvseal.wire.kvspec import KVSpec
from kvseal.wire.reservation import Reservation
from tests.helpers.cards import CARD, card

DECODE = card(role="decode", reservation_timeout_s=120.0)


def _info(c: WorkerCard = CARD, **figures: object) -> P.InfoResp:
    return P.InfoResp(call_id=7, card=c, draining=False, figures=dict(figures))


@pytest.mark.parametrize("c", [CARD, DECODE])
def test_a_card_round_trips_through_the_protocol(c: WorkerCard) -> None:
    back = P.decode(P.encode(_info(c, free_pages=3)))
    assert isinstance(back, P.InfoResp)
    assert back == _info(c, free_pages=3) and back.card == c and isinstance(back.card.kv, KVSpec)


@pytest.mark.parametrize("field", [f for f in WorkerCard.__struct_fields__])
def test_a_card_missing_any_field_is_a_decode_error_not_a_default(field: str) -> None:
    card_map = {k: v for k, v in msgspec.to_builtins(CARD).items() if k != field}
    frame = msgspec.msgpack.encode({"kind": "info", "v": 1, "call_id": 1, "card": card_map, "draining": False,
                                    "figures": {}})
    with pytest.raises(msgspec.ValidationError, match=f"missing required field `{field}`"):
        P.decode(frame)


@pytest.mark.parametrize("field", [f for f in KVSpec.__struct_fields__])
def test_a_kv_spec_missing_any_field_is_a_decode_error(field: str) -> None:
    card_map = msgspec.to_builtins(CARD)
    card_map["kv"] = {k: v for k, v in card_map["kv"].items() if k != field}
    frame = msgspec.msgpack.encode({"kind": "info", "v": 1, "call_id": 1, "card": card_map, "draining": False,
                                    "figures": {}})
    with pytest.raises(msgspec.ValidationError, match=f"missing required field `{field}`"):
        P.decode(frame)
    res = msgspec.to_builtins(Reservation(request_id="r", reservation_id="x", nonce="n", num_tokens=1, page_ids=[0],
                                          kv=CARD.kv, kv_endpoint="tcp://127.0.0.1:1"))
    res["kv"].pop(field)
    with pytest.raises(msgspec.ValidationError, match=f"missing required field `{field}`"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(res), type=Reservation)


def test_info_json_keeps_the_keys_info_always_had() -> None:
    prefill, decode = CARD.to_json(), DECODE.to_json()
    assert "kv" not in prefill and "reservation_timeout_s" not in prefill  # a prefill worker holds no reservation
    assert decode["reservation_timeout_s"] == 120.0
    for key, value in CARD.kv.fields().items():
        assert prefill[key] == value  # model_fingerprint, page_size, kv_dtype, kv_layout at the top level
    assert set(prefill) == {*WorkerCard.__struct_fields__, *KVSpec.__struct_fields__} - {"kv", "reservation_timeout_s"}
    assert WorkerCard.from_json(prefill) == CARD and WorkerCard.from_json(decode) == DECODE
    with pytest.raises(msgspec.ValidationError, match="tokenizer_digest"):
        WorkerCard.from_json({k: v for k, v in prefill.items() if k != "tokenizer_digest"})


def test_a_figure_never_hides_a_card_field() -> None:
    out = _info(CARD, page_size=999, free_pages=3).to_json()
    assert out["page_size"] == 16 and out["free_pages"] == 3 and out["draining"] is False


def test_a_worker_whose_card_does_not_decode_is_refused_at_once_with_the_reason() -> None:
    """A worker of another kvseal version (its card lacks a field) answers an info request with a frame the router
    cannot read: its join is refused at once, saying why, instead of waiting for an answer that never decodes."""
    old = {k: v for k, v in msgspec.to_builtins(CARD).items() if k != "tokenizer_digest"}
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if sock.poll(50):
                ident, data = sock.recv_multipart()
                msg = P.decode(data)
                assert isinstance(msg, P.InfoReq)
                sock.send_multipart([ident, msgspec.msgpack.encode(
                    {"kind": "info", "v": 1, "call_id": msg.call_id, "card": old, "draining": False, "figures": {}})])

    async def join() -> tuple[Standing, str]:
        actx = zmq.asyncio.Context()
        w = WorkerClient("prefill", f"tcp://127.0.0.1:{port}", actx, check=lambda w, c: None)
        w.open()
        try:
            t0 = time.monotonic()
            await w.join()
            assert time.monotonic() - t0 < 5  # refused on the answer, not after the 10 s info timeout
            return w.member.standing, w.member.reason
        finally:
            await w.close()
            actx.term()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        standing, reason = asyncio.run(join())
    finally:
        stop.set()
        server.join()
        sock.close(0)
        ctx.term()
    assert standing is Standing.REFUSED
    assert "another kvseal version" in reason and "tokenizer_digest" in reason, reason

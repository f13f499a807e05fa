"""Seal 7's fleet check as a function: every field that must agree is compared, all differences are named."""

from __future__ import annotations

import msgspec
import pytest

from kvseal.errors import CapacityMismatch
from kvseal.router.registry import Agreement, FleetSpec, check_fleet, check_worker
from kvseal.wire import protocol as P
from tests.helpers.cards import card

BASE = card().to_json()  # the values, by the names /info and the error messages use


@pytest.mark.parametrize(("field", "value"), [("model_fingerprint", "g"), ("page_size", 32), ("kv_dtype", "bfloat16"),
                                              ("kv_layout", "L30xPxSx3x64"), ("kernels", "torch"),
                                              ("arithmetic", "exact/native")])
def test_a_worker_that_differs_in_any_field_is_refused(field: str, value: object) -> None:
    with pytest.raises(CapacityMismatch, match=f"{field}={value!r}.*but.*{field}={BASE[field]!r}"):
        check_fleet([("prefill 1", card()), ("decode 1", card(**{field: value}))], 4096)


def test_a_fleet_that_mixes_kv_transports_is_refused_with_both_fixes() -> None:
    with pytest.raises(CapacityMismatch) as e:
        check_fleet([("prefill 1", card(kv_transport="zmq")), ("decode 1", card(kv_transport="nixl"))], 4096)
    msg = str(e.value)
    assert "decode 1 moves KV with --kv-transport nixl but prefill 1 with --kv-transport zmq" in msg
    assert "every worker with --kv-transport zmq, or every worker with --kv-transport nixl" in msg
    check_fleet([("prefill 1", card(kv_transport="nixl")), ("decode 1", card(kv_transport="nixl"))], 4096)
    with pytest.raises(CapacityMismatch, match="--kv-transport nixl but prefill 1 with --kv-transport zmq"):
        check_fleet([("prefill 1", card()), ("decode 1", card(kv_transport="nixl"))], 4096)  # the card's: zmq


def test_every_difference_is_named_at_once_and_a_small_pool_is_refused() -> None:
    other = card(arithmetic="exact/native", kv_layout="L30xPxSx3x64")
    with pytest.raises(CapacityMismatch) as e:
        check_fleet([("prefill 1", card()), ("decode 1", other)], 4096)
    assert "kv_layout='L30xPxSx3x64'" in str(e.value) and "arithmetic='exact/native'" in str(e.value)
    with pytest.raises(CapacityMismatch, match="holds 2048 tokens"):
        check_fleet([("prefill 1", card()), ("decode 1", card(pool_tokens=2048))], 4096)
    check_fleet([("prefill 1", card()), ("decode 1", card())], 8192)  # an agreeing fleet passes


SPEC = FleetSpec(window=4096, agreed=Agreement.of(card()), tokenizer_digest="sha256:t", test_faults="")
JOINER = card(role="prefill", context_window=4096, tokenizer_digest="sha256:t", test_faults="")  # == card()


@pytest.mark.parametrize(("change", "message"), [
    ({"pool_tokens": 1024}, "holds 1024 tokens, fewer than the 4096-token context window"),
    ({"context_window": 2048}, "serves a context window of 2048 tokens, smaller than the 4096-token window"),
    ({"page_size": 32}, "page_size=32 but the fleet has page_size=16"),
    ({"arithmetic": "exact/native"}, "arithmetic='exact/native'"),
    ({"tokenizer_digest": "sha256:other"}, "tokenizer sha256:other but the router has sha256:t"),
    ({"test_faults": "flip_byte"}, "test faults 'flip_byte' but the router with 'none'"),
    ({"role": "decode", "reservation_timeout_s": 120.0}, "is a 'decode' worker, not a 'prefill' one"),
    ({"kv_transport": "nixl"}, "moves KV with --kv-transport nixl but the fleet with --kv-transport zmq"),
    ({"reservation_timeout_s": 120.0}, "a prefill worker that reports reservation_timeout_s=120.0"),
])
def test_a_joining_worker_is_checked_in_full(change: dict, message: str) -> None:
    assert JOINER == card()
    check_worker("prefill 2", "prefill", JOINER, SPEC)  # the unchanged worker passes
    with pytest.raises(CapacityMismatch, match=message.replace("(", r"\(")):
        check_worker("prefill 2", "prefill", card(**change), SPEC)  # JOINER with the change


def test_a_decode_worker_reports_its_reservation_timeout() -> None:
    check_worker("decode 2", "decode", card(role="decode", reservation_timeout_s=120.0), SPEC)
    with pytest.raises(CapacityMismatch, match="a decode worker that reports reservation_timeout_s=None"):
        check_worker("decode 2", "decode", card(role="decode"), SPEC)


def test_a_worker_of_another_version_is_refused_and_the_incident_fault_skips_only_capacity() -> None:
    # a card without tokenizer_digest (a worker of another version) does not decode: no check runs on a default
    old = {k: v for k, v in msgspec.to_builtins(JOINER).items() if k != "tokenizer_digest"}
    frame = msgspec.msgpack.encode({"kind": "info", "v": 1, "call_id": 1, "card": old, "draining": False,
                                    "figures": {}})
    with pytest.raises(msgspec.ValidationError, match="missing required field `tokenizer_digest`"):
        P.decode(frame)
    check_worker("prefill 2", "prefill", card(pool_tokens=512, context_window=512), SPEC, capacity=False)
    with pytest.raises(CapacityMismatch, match="page_size"):
        check_worker("prefill 2", "prefill", card(page_size=32), SPEC, capacity=False)

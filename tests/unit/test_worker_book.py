"""A worker keeps each request in one record, its Sequence, in one book (engine/requests.py), on real workers over
the tiny model: what is in flight and live, whose router a request answers, and what a lost router ends are all
read from that book. A router that is given up ends only its own requests (a queued reservation leaves unanswered,
a reserved one FAILS with its pages freed) and is sent nothing more; another router's requests go on. A prefill
request its router aborted is not answered; one its router still waits for is answered once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvseal.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvseal.engine.engine import Engine
from kvseal.errors import ErrorInfo
from kvseal.hooks import NO_FAULTS
from kvseal.wire import protocol as P
from kvseal.wire.messages import GenerateRequest, SamplingParams
from kvseal.wire.reservation import Reservation, new_nonce, new_reservation_id
from kvseal.wire.roles import Role
from kvseal.worker.decode import DecodeWorker
from kvseal.worker.prefill import PrefillWorker
from tests.helpers.halves import prefill_engine

from .conftest import tiny_checkpoint

CK = tiny_checkpoint()
A, B = b"router-a", b"router-b"
CFG = EngineConfig(model=ModelConfig(max_model_len=64), cache=CacheConfig(page_size=4, pool_tokens=64),
                   scheduler=SchedulerConfig(max_num_batched_tokens=32))


def _capture(w: DecodeWorker | PrefillWorker) -> list[tuple[bytes, P.Message]]:
    sent: list[tuple[bytes, P.Message]] = []
    w.send = lambda ident, msg: sent.append((ident, msg))  # type: ignore[method-assign]
    return sent


def _req(rid: str, prompt: int = 24) -> GenerateRequest:
    return GenerateRequest(rid, [5] * prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))


@pytest.fixture()
def decode() -> Iterator[DecodeWorker]:
    w = DecodeWorker(Engine(CFG, CK, role=Role.DECODE), "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", NO_FAULTS)
    yield w
    w.close()


@pytest.fixture()
def prefill() -> Iterator[PrefillWorker]:
    w = PrefillWorker(Engine(CFG, CK, role=Role.PREFILL), "tcp://127.0.0.1:0", NO_FAULTS)
    yield w
    w.close()


def test_a_lost_router_ends_only_its_own_requests_and_hears_nothing_more(decode: DecodeWorker) -> None:
    sent = _capture(decode)
    decode.handle(A, P.ReserveReq(call_id=1, request=_req("a1")))  # 6 of the 16 pages
    decode.handle(B, P.ReserveReq(call_id=2, request=_req("b1")))  # 6 more
    decode.handle(A, P.ReserveReq(call_id=3, request=_req("a2")))  # does not fit: queued
    decode.handle(A, P.ReserveReq(call_id=4, request=_req("a3")))  # queued behind it
    assert [s.request_id for s in decode.queue] == ["a2", "a3"] and decode.inflight() == 4
    before = len(sent)
    decode.handle(A, P.AbortReq(request_id="a3", error=ErrorInfo("RequestAborted", "gone", 499, "aborted")))
    decode.route(decode.engine.take_addressed())
    assert len(sent) == before and not decode.is_live("a3")  # a queued reservation leaves unanswered
    free = decode.engine.figures()["free_pages"]

    decode.peer_lost(A)
    decode.route(decode.engine.take_addressed())

    assert not decode.is_live("a1") and not decode.is_live("a2") and decode.is_live("b1")
    assert decode.inflight() == 1 and decode.queue == [] and decode.engine.routed_to(A) == []
    assert decode.engine.figures()["free_pages"] == free + 6  # a1's reserved pages came back
    assert all(ident != A for ident, _ in sent[before:])  # a1's final delta had nowhere to go, a2 no answer
    decode.pump()  # a2 is not granted later either: it left the queue
    assert all(ident != A for ident, _ in sent[before:])
    decode.handle(B, P.StatusReq(call_id=9, request_id="b1"))
    assert sent[-1] == (B, P.StatusResp(call_id=9, live=True, sent=0))


def test_a_request_answers_the_router_that_asked_and_numbers_its_deltas(decode: DecodeWorker) -> None:
    sent = _capture(decode)
    req = _req("b1", prompt=9)
    decode.handle(B, P.ReserveReq(call_id=7, request=req))
    ((ident, resp),) = sent
    assert ident == B and isinstance(resp, P.ReserveResp) and resp.call_id == 7 and resp.reservation is not None
    p = prefill_engine(CFG, CK)  # prefill computes the prompt's KV; decode verifies it and decodes
    p.add_request(req)
    while not (ready := p.kv.take_ready()):
        p.step()
    decode.kv.accept(*p.kv.package(ready[0], resp.reservation))  # type: ignore[arg-type]
    while decode.engine.has_work():
        decode.engine.advance()
        decode.route(decode.engine.take_addressed())
        decode.handle(B, P.StatusReq(call_id=0, request_id="b1"))
    deltas = [m for ident, m in sent if isinstance(m, P.DeltaMsg)]
    assert all(ident == B for ident, m in sent) and len(deltas) == 4  # its first token, then 3 steps
    assert [m.seq for m in deltas] == [0, 1, 2, 3] and deltas[-1].delta.final == "length"
    statuses = [m for _, m in sent if isinstance(m, P.StatusResp)]
    assert [m.sent for m in statuses] == [2, 3, 0] and not statuses[-1].live  # ended: it left the book


def _reservation(w: PrefillWorker, rid: str) -> Reservation:
    return Reservation(request_id=rid, reservation_id=new_reservation_id(), nonce=new_nonce(), num_tokens=24,
                       page_ids=list(range(6)), kv=w.engine.kv_spec, kv_endpoint="tcp://127.0.0.1:1")


def test_prefill_answers_each_request_once_and_only_to_its_router(prefill: PrefillWorker) -> None:
    sent = _capture(prefill)
    for ident, rid in ((A, "a1"), (B, "b1"), (B, "b2")):
        prefill.handle(ident, P.PrefillReq(call_id=len(rid), request=_req(rid), reservation=_reservation(prefill, rid)))
    prefill.handle(B, P.PrefillReq(call_id=5, request=_req("b3", prompt=100), reservation=_reservation(prefill, "b3")))
    prefill.route(prefill.engine.take_addressed())  # b3 is over the 64-token window: refused at the door
    ((ident, refused),) = sent
    assert ident == B and isinstance(refused, P.PrefillResp) and refused.call_id == 5
    assert refused.state == "rejected" and refused.error is not None
    assert refused.error.code == "context_length_exceeded"

    prefill.handle(B, P.AbortReq(request_id="b2", error=ErrorInfo("RequestAborted", "gone", 499, "aborted")))
    prefill.peer_lost(A)
    prefill.route(prefill.engine.take_addressed())
    assert sent[1:] == []  # b2 was aborted by its router, a1's router is gone: neither is answered
    assert prefill.inflight() == 1 and prefill.is_live("b1") and not prefill.is_live("a1")
    assert prefill.engine.routed_to(A) == [] and [s.request_id for s in prefill.engine.routed_to(B)] == ["b1"]

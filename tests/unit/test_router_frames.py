"""What the router hands a request from its workers' connections (router/disagg_request.py): each worker
connection's reader finds the request in the router's one home and hands it the frame; the request takes only
frames from its own workers. A fleet member that is not the request's decode worker cannot put output into it,
end it, or announce its handoff; its own decode worker's deltas must arrive numbered 0, 1, 2, ...."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvseal.errors import StreamBroken, WorkerFailed
from kvseal.router.disagg_request import DEFAULT_TIMEOUTS, DisaggRequest
from kvseal.wire import protocol as P
from kvseal.wire.kvspec import KVSpec
from kvseal.wire.messages import GenerateDelta, GenerateRequest, SamplingParams
from kvseal.wire.reservation import Reservation

RID = "cmpl-frames"


@dataclass
class _Card:
    reservation_timeout_s: float = 60.0


@dataclass
class Worker:
    """A worker as the request sees it: its calls never answer (the prefill is still computing)."""

    name: str
    card: _Card = field(default_factory=_Card)
    inflight: int = 0

    def routed(self, tenant: str, n: int = 1) -> None:
        self.inflight += n

    async def call(self, make: Any, timeout: float | None) -> P.Message:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def notify(self, msg: P.Message) -> None:
        pass


def _delta(seq: int, tok: int) -> P.DeltaMsg:
    return P.DeltaMsg(seq=seq, delta=GenerateDelta(RID, [tok], f"<{tok}>"))


def _request(prefill: Worker, decode: Worker) -> DisaggRequest:
    r = DisaggRequest(GenerateRequest(RID, [1, 2, 3], SamplingParams(max_tokens=8)), DEFAULT_TIMEOUTS)
    r.prefill, r.decode = prefill, decode  # type: ignore[assignment]  # as reserve() pairs them
    r.reservation = Reservation(request_id=RID, reservation_id="r1", nonce="00" * 16, num_tokens=3, page_ids=[0],
                                kv=KVSpec(model_fingerprint="f", page_size=16, kv_dtype="float32", kv_layout="l"),
                                kv_endpoint="tcp://127.0.0.1:1")  # as decode grants it
    r.start_prefill()
    return r


def test_only_the_requests_own_workers_frames_reach_it() -> None:
    async def scenario() -> list[GenerateDelta]:
        p1, d1, p2, d2 = Worker("prefill 1"), Worker("decode 1"), Worker("prefill 2"), Worker("decode 2")
        r = _request(p1, d1)
        r.take_delta(d2, _delta(0, 666))  # another member's output for this request id: dropped
        r.take_delta(p1, _delta(0, 667))  # even from the request's own prefill worker
        r.worker_lost(d2, WorkerFailed("decode 2 is gone").to_info())  # another worker lost: not this request's
        r.handoff_started(p2)
        assert not r._started.is_set()  # only its prefill worker announces its handoff
        r.handoff_started(p1)
        assert r._started.is_set()
        r.take_delta(d1, _delta(0, 7))
        r.take_delta(d1, _delta(1, 8))
        got = [await r.next_delta(), await r.next_delta()]
        await r.end()
        return got

    got = asyncio.run(scenario())
    assert [d.token_ids for d in got] == [[7], [8]]


def test_a_hole_in_decodes_numbering_fails_the_request_and_nothing_after_it_is_passed_on() -> None:
    async def scenario() -> tuple[GenerateDelta, Exception]:
        p1, d1 = Worker("prefill 1"), Worker("decode 1")
        r = _request(p1, d1)
        r.take_delta(d1, _delta(0, 7))
        r.take_delta(d1, _delta(2, 9))  # delta 1 lost
        r.take_delta(d1, _delta(1, 8))  # late: not passed on
        first = await r.next_delta()
        with pytest.raises(StreamBroken) as err:
            await r.next_delta()
        await r.end()
        return first, err.value

    first, err = asyncio.run(scenario())
    assert first.token_ids == [7]
    assert "hole" in err.message and "1 lost" in err.message


def test_losing_its_decode_worker_fails_the_request() -> None:
    async def scenario() -> Exception:
        p1, d1 = Worker("prefill 1"), Worker("decode 1")
        r = _request(p1, d1)
        r.worker_lost(d1, WorkerFailed("decode 1 is gone").to_info())
        r.take_delta(d1, _delta(0, 7))  # after the loss: nothing more is passed on
        with pytest.raises(WorkerFailed) as err:
            await r.next_delta()
        await r.end()
        return err.value

    assert "decode 1 is gone" in asyncio.run(scenario()).message

"""Bursts queue instead of failing (finding 4 of issue 10), on a real DecodeWorker over the tiny model: a
reservation that finds no free pages waits in arrival order, bounded by max_waiting (then 503 at once); one that
can never fit is refused at once with the reason; one whose client left (AbortReq) leaves the queue; and the
queue is not timed out while pages are being freed."""

from __future__ import annotations

import time

import pytest

from kvseal.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvseal.engine.engine import Engine
from kvseal.errors import ErrorInfo
from kvseal.hooks import NO_FAULTS
from kvseal.wire import protocol as P
from kvseal.wire.messages import GenerateRequest, SamplingParams
from kvseal.worker.decode import DecodeWorker

from .conftest import tiny_checkpoint

CK = tiny_checkpoint()
ROUTER = b"router-1"


@pytest.fixture()
def worker() -> DecodeWorker:
    cfg = EngineConfig(model=ModelConfig(max_model_len=64), cache=CacheConfig(page_size=4, pool_tokens=64),
                       scheduler=SchedulerConfig(max_num_batched_tokens=32, max_waiting=3, wait_timeout_s=0.5))
    w = DecodeWorker(Engine(cfg, CK, role="decode"), "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", NO_FAULTS)
    w.sent = []  # type: ignore[attr-defined]
    w.send = lambda ident, msg: w.sent.append((ident, msg))  # type: ignore[method-assign, attr-defined]
    yield w
    w.close()


def reserve(w: DecodeWorker, rid: str, prompt: int = 24, max_tokens: int = 4) -> None:
    req = GenerateRequest(rid, [5] * prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    w.handle(ROUTER, P.ReserveReq(call_id=hash(rid) % 10**6, request=req))


def answers(w: DecodeWorker) -> dict[str, P.ReserveResp]:
    out = {}
    for _, msg in w.sent:  # type: ignore[attr-defined]
        if isinstance(msg, P.ReserveResp):
            rid = msg.reservation.request_id if msg.reservation else msg.error.message  # type: ignore[union-attr]
            out[rid] = msg
    return out


def test_reservations_wait_in_arrival_order_and_the_queue_is_bounded(worker: DecodeWorker) -> None:
    reserve(worker, "a")  # 24 tokens: 6 of the 16 pages
    reserve(worker, "b")  # 6 more: 12 taken
    reserve(worker, "c")  # does not fit now: queued, no answer yet
    reserve(worker, "d", prompt=8)  # would fit (2 pages) but c came first: queued behind it
    assert set(answers(worker)) == {"a", "b"} and [q.request.request_id for q in worker.queue] == ["c", "d"]
    reserve(worker, "e", prompt=8)
    reserve(worker, "f", prompt=8)  # the fourth waiting: over max_waiting 3, refused at once with 503
    (refusal,) = [m for m in answers(worker).values() if m.error is not None]
    assert refusal.error.status == 503 and refusal.error.code == "overloaded" and "max-waiting 3" in \
        refusal.error.message  # type: ignore[union-attr]
    worker.handle(ROUTER, P.AbortReq(request_id="e", error=ErrorInfo("RequestAborted", "gone", 499, "aborted")))
    assert [q.request.request_id for q in worker.queue] == ["c", "d"]  # a client that left frees its place
    worker.handle(ROUTER, P.ReleaseReq(request_id="a", error=ErrorInfo("X", "x", 500, "x"), rejected=True))
    worker.pump()  # a's pages came back: c, then d, in that order
    granted = [m.reservation.request_id for _, m in worker.sent if isinstance(m, P.ReserveResp)  # type: ignore
               and m.reservation is not None]
    assert granted == ["a", "b", "c", "d"] and not worker.queue


def test_a_request_that_can_never_fit_is_refused_at_once(worker: DecodeWorker) -> None:
    reserve(worker, "a")
    reserve(worker, "b")
    reserve(worker, "huge", prompt=60, max_tokens=10)  # 70 tokens: more than the 64-token window and pool
    (msg,) = [m for _, m in worker.sent if isinstance(m, P.ReserveResp) and m.error is not None]  # type: ignore
    assert msg.error.code == "context_length_exceeded" and not worker.queue


def test_a_queue_that_moves_is_never_timed_out_one_that_cannot_is(worker: DecodeWorker) -> None:
    reserve(worker, "a")
    reserve(worker, "b")
    reserve(worker, "c")
    time.sleep(0.6)
    worker.engine.scheduler.last_freed = time.monotonic()  # pages were freed just now: progress
    worker.pump()
    assert [q.request.request_id for q in worker.queue] == ["c"]
    time.sleep(0.6)  # wait_timeout 0.5 s with no page freed at all: nothing can move
    worker.pump()
    assert not worker.queue
    (msg,) = [m for _, m in worker.sent if isinstance(m, P.ReserveResp) and m.error is not None]  # type: ignore
    assert msg.error.status == 503 and "no KV pages were freed" in msg.error.message


def test_queued_reservations_go_to_the_tenant_served_least_first(worker: DecodeWorker) -> None:
    def ask(rid: str, tenant: str, prompt: int = 24) -> None:
        req = GenerateRequest(rid, [5] * prompt, SamplingParams(max_tokens=4, temperature=0.0), tenant=tenant)
        worker.handle(ROUTER, P.ReserveReq(call_id=hash(rid) % 10**6, request=req))

    ask("a1", "a")
    ask("a2", "a")  # a holds 12 of the 16 pages
    worker.engine.scheduler.fair.books["a"].counter = 500.0  # a has been served a lot here
    ask("a3", "a")  # queued: does not fit
    ask("b1", "b")  # queued behind a3 in arrival order, but b was served least
    worker.handle(ROUTER, P.ReleaseReq(request_id="a1", error=ErrorInfo("X", "x", 500, "x"), rejected=True))
    worker.pump()  # room for one: b1 gets it, a3 still waits (nothing skips ahead of b1 meanwhile)
    granted = [m.reservation.request_id for _, m in worker.sent if isinstance(m, P.ReserveResp)  # type: ignore
               and m.reservation is not None]
    assert granted == ["a1", "a2", "b1"] and [q.request.request_id for q in worker.queue] == ["a3"]


def test_a_tenant_at_its_kv_share_waits_without_holding_back_another(worker: DecodeWorker) -> None:
    def ask(rid: str, tenant: str, share: float) -> None:
        req = GenerateRequest(rid, [5] * 16, SamplingParams(max_tokens=4, temperature=0.0), tenant=tenant,
                              kv_share=share)
        worker.handle(ROUTER, P.ReserveReq(call_id=hash(rid) % 10**6, request=req))

    ask("a1", "a", 0.5)  # 5 of the 16 pages at its longest (20 tokens)
    ask("a2", "a", 0.5)  # 10 of its 8: over its share, queued though the pool has room
    ask("b1", "b", 1.0)  # another tenant: granted at the worker's next turn, not behind a2
    worker.pump()
    granted = [m.reservation.request_id for _, m in worker.sent if isinstance(m, P.ReserveResp)  # type: ignore
               and m.reservation is not None]
    assert granted == ["a1", "b1"] and [q.request.request_id for q in worker.queue] == ["a2"]
    worker.handle(ROUTER, P.ReleaseReq(request_id="a1", error=ErrorInfo("X", "x", 500, "x"), rejected=True))
    worker.pump()  # a holds nothing now: a2 may go
    assert not worker.queue

"""A tenant under its fair share of the KV pool does not wait for a tenant over it (issue 19), on the tiny model:
in one engine (unified) and on a real DecodeWorker's reservation path, a request of tenant b that finds every page
held by tenant a preempts a's newest request (recomputed later), and starts before any of a's requests ends; with
fairness off it waits. Every output stays token for token what greedy gives alone, the victim's pages are scrubbed,
each request ends once, and the pools return to their baseline. While two tenants compete, prompt chunks are
capped."""

from __future__ import annotations

import pytest

from kvseal.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvseal.engine.engine import Engine
from kvseal.errors import ErrorInfo
from kvseal.hooks import NO_FAULTS
from kvseal.lifecycle import State
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire import protocol as P
from kvseal.wire.messages import GenerateDelta, GenerateRequest, SamplingParams
from kvseal.worker.decode import DecodeWorker
from tests.helpers.halves import prefill_engine

from .test_engine import assert_one_final_each, prompt, run_alone, tokens

LONG = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def preempted(e: Engine, rid: str) -> bool:
    s = e.request(rid)
    return s is not None and [to for to, _ in s.life.history].count(State.ADMITTED) > 1


def test_a_tenant_under_its_share_preempts_the_tenant_over_it(tiny: Checkpoint) -> None:
    a_ids = [prompt(60, 50 + i) for i in range(2)]  # at their longest (80 tokens, 20 pages) a's two fill the pool
    b_ids = prompt(10, 99)
    a_params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    def run(fairness: str) -> tuple[dict[str, list[GenerateDelta]], list[str], bool, Engine]:
        e = Engine(EngineConfig(cache=CacheConfig(page_size=4, pool_tokens=160),  # 40 pages
                                scheduler=SchedulerConfig(max_num_batched_tokens=64, fairness=fairness)), tiny)
        for i, ids in enumerate(a_ids):
            e.add_request(GenerateRequest(f"a{i}", ids, a_params, tenant="a"))
        out: dict[str, list[GenerateDelta]] = {}
        events: list[str] = []  # b's first token and the ends of a's requests, in order
        victims: set[str] = set()
        for _ in range(40):  # a fills the pool: b's prompt (3 pages) does not fit
            for d in e.step():
                out.setdefault(d.request_id, []).append(d)
            if e.allocator.num_free < 3:
                break
        assert e.allocator.num_free < 3 and {s.tenant for s in e.scheduler.running} == {"a"}
        assert not any(d.final for ds in out.values() for d in ds)
        scrubbed = e.pages_scrubbed
        e.add_request(GenerateRequest("b", b_ids, SHORT, tenant="b"))
        while e.has_work():
            for d in e.step():
                out.setdefault(d.request_id, []).append(d)
                if d.request_id == "b" and len(out["b"]) == 1 or d.request_id != "b" and d.final is not None:
                    events.append(d.request_id)
            victims |= {s.request_id for s in e.requests if preempted(e, s.request_id)}
            e.allocator.check_integrity()
        assert_one_final_each(out)
        assert [tokens(out[f"a{i}"]) for i in range(2)] == [run_alone(tiny, ids, a_params) for ids in a_ids]
        assert tokens(out["b"]) == run_alone(tiny, b_ids, SHORT)
        assert e.allocator.num_free == e.pool.num_pages  # seal 8
        return out, events, bool(victims) and e.pages_scrubbed > scrubbed, e

    _, events, made_room, _ = run("vtc")
    assert events[0] == "b" and made_room  # b's first token before any of a's requests ended: a was preempted
    _, events, made_room, _ = run("off")
    assert events[0] != "b" and not made_room  # off: b waits for one of a's requests to end


def test_the_room_victim_is_from_the_tenant_over_its_share_only() -> None:
    from types import SimpleNamespace

    from kvseal.engine.fairness import FairShare

    def seq(tenant: str, arrival: float, pages: int, weight: float = 1.0, cls: int = 0) -> object:
        return SimpleNamespace(tenant=tenant, arrival=arrival, priority=0, priority_class=cls, weight=weight,
                               pages=[0] * pages)

    f = FairShare("vtc")
    a1, a2, c1 = seq("a", 1.0, 30), seq("a", 2.0, 30), seq("c", 3.0, 30)
    weights = {"a": 1.0, "b": 1.0, "c": 1.0}
    held = {"a": 60, "c": 30}  # of 90 pages, a fair share is 30: a holds 60
    assert f.room_victim([a1, a2, c1], "b", 0, 5, held, weights, 90) is a2  # a's newest; c is at its share
    assert f.room_victim([a1, a2, c1], "b", 0, 5, {**held, "b": 28}, weights, 90) is None  # b would pass its share
    assert f.room_victim([a1, a2, c1], "b", 0, 40, {**held, "b": 0}, weights, 90) is a2  # holding none: one may go
    # a of weight 4: its share is 60 of 90 and c's 15: c is the one over its share now
    assert f.room_victim([a1, a2, c1], "b", 0, 5, held, {**weights, "a": 4.0}, 90) is c1
    assert f.room_victim([a1, a2, c1], "b", 1, 5, held, weights, 90) is None  # a higher class is not preempted
    assert FairShare("off").room_victim([a1, a2, c1], "b", 0, 5, held, weights, 90) is None
    # b would pass its share with them: a request of a may go only while a keeps another one running
    assert f.room_victim([a1, c1], "b", 0, 40, {"a": 31, "c": 30}, weights, 90) is None
    assert f.room_victim([a1, a2, c1], "b", 0, 40, {**held, "b": 0}, weights, 90) is a2
    # (the engine's twin: tests/unit/test_spec_engine.py's preempted case preempted two lone requests in turn forever)


def test_prompt_chunks_are_capped_while_two_tenants_compete(tiny: Checkpoint) -> None:
    e = Engine(EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=128, contended_chunk_tokens=32)), tiny)
    e.add_request(GenerateRequest("a0", prompt(100, 1), SHORT, tenant="a"))
    e.step()
    assert e.scheduler.running[0].num_computed == 100  # alone: one full chunk
    e.add_request(GenerateRequest("a1", prompt(100, 2), SHORT, tenant="a"))
    e.add_request(GenerateRequest("b0", prompt(100, 3), SHORT, tenant="b"))
    e.step()
    assert e.request("a1").num_computed + e.request("b0").num_computed == 32  # one capped chunk between them
    assert e.request("b0").num_computed == 32  # equal counters: b, holding nothing here, before a (a0 decodes)
    e.step()  # a1 is a newcomer (a has no prompt running, b has): its step, b0's chunk sits it out
    assert (e.request("a1").num_computed, e.request("b0").num_computed) == (32, 32)
    e.step()  # both prompts run: a running chunk (of a1 or b0) takes its cap, and both have moved
    assert e.request("a1").num_computed + e.request("b0").num_computed == 96
    assert e.request("a1").num_computed > 0 and e.request("b0").num_computed > 0
    off = Engine(EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=128, contended_chunk_tokens=32,
                                                        fairness="off")), tiny)
    off.add_request(GenerateRequest("a1", prompt(100, 2), SHORT, tenant="a"))
    off.add_request(GenerateRequest("b0", prompt(100, 3), SHORT, tenant="b"))
    off.step()
    assert off.request("a1").num_computed + off.request("b0").num_computed == 128  # off: no cap


def test_a_newcomers_short_prompt_gets_a_step_of_its_own_and_the_flood_resumes_after(tiny: Checkpoint) -> None:
    """A floods long prompts; B's short chat arrives while a chunk of A's runs: the next step is B's whole prompt
    (and the decode tokens), A's prompt chunk sits it out and resumes the step after. Outputs stay what they are
    alone, one final each."""
    e = Engine(EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=128, contended_chunk_tokens=32)), tiny)
    a_ids = {f"a{i}": prompt(100, 10 + i) for i in range(3)}
    b_ids = prompt(12, 77)
    out: dict[str, list[GenerateDelta]] = {}
    for rid, ids in a_ids.items():
        e.add_request(GenerateRequest(rid, ids, SHORT, tenant="a"))
    for _ in range(2):  # a alone: full chunks (100 + 28, then a0's first decode token + 72 + 55)
        for d in e.step():
            out.setdefault(d.request_id, []).append(d)
    a2 = e.request("a2").num_computed
    assert a2 == 55  # 45 prompt tokens to go
    e.add_request(GenerateRequest("b0", b_ids, SHORT, tenant="b"))
    for d in e.step():
        out.setdefault(d.request_id, []).append(d)
    assert e.request("b0").num_computed == 12 and len(out["b0"]) == 1  # its whole prompt, and its first token
    assert e.request("a2").num_computed == a2  # a's chunk sat this step out
    for d in e.step():
        out.setdefault(d.request_id, []).append(d)
    assert e.request("a2").num_computed == a2 + 32  # and resumes at once (capped: both tenants compete)
    while e.has_work():
        for d in e.step():
            out.setdefault(d.request_id, []).append(d)
    assert_one_final_each(out)
    for rid, ids in [*a_ids.items(), ("b0", b_ids)]:
        assert tokens(out[rid]) == run_alone(tiny, ids, SHORT), rid


def test_a_tenant_that_sends_a_short_request_every_step_does_not_starve_a_long_prompt(tiny: Checkpoint) -> None:
    """b's requests are newcomers' steps only while b was served no more than a: then a's chunks run again (with
    a step of its own for every such request of b's, a's prompt would never move)."""
    e = Engine(EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=128, contended_chunk_tokens=32)), tiny)
    e.add_request(GenerateRequest("a0", prompt(400, 1), SHORT, tenant="a"))
    e.step()
    assert e.request("a0").num_computed == 128  # alone: a full chunk
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(20):
        e.add_request(GenerateRequest(f"b{i}", prompt(8, 100 + i), one, tenant="b"))
        e.step()
    assert e.request("a0").num_computed >= 128 + 3 * 32  # measured: 256 (four capped chunks in 20 steps)
    books = e.scheduler.fair.books
    assert abs(books["a"].counter - books["b"].counter) <= 32 + 8  # about one step's cost apart


def _cfg(fairness: str) -> EngineConfig:
    return EngineConfig(model=ModelConfig(max_model_len=64), cache=CacheConfig(page_size=4, pool_tokens=64),
                        scheduler=SchedulerConfig(max_num_batched_tokens=32, fairness=fairness))


@pytest.mark.parametrize("fairness", ["vtc", "off"])
def test_a_reservation_under_its_share_preempts_decoding_requests_over_it(tiny: Checkpoint, fairness: str) -> None:
    """On a real DecodeWorker: a's two requests decode and hold the pool (16 pages); b's reservation does not fit.
    vtc: a's newest is preempted (its pages scrubbed, recomputed on decode later) and b is granted at once; off: b
    waits. Outputs equal greedy alone, one final each, both pools back to baseline."""
    w = DecodeWorker(Engine(_cfg(fairness), tiny, role="decode"), "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", NO_FAULTS)
    p = prefill_engine(_cfg(fairness), tiny)
    sent: list[P.Message] = []
    w.send = lambda ident, msg: sent.append(msg)  # type: ignore[method-assign]
    d = w.engine
    out: dict[str, list[GenerateDelta]] = {}
    ids = {"a1": prompt(24, 71), "a2": prompt(24, 72), "b": prompt(12, 73)}
    params = {"a1": LONG, "a2": LONG, "b": SHORT}
    try:
        def ask(rid: str) -> None:
            w.handle(b"r", P.ReserveReq(call_id=len(sent), request=GenerateRequest(rid, ids[rid], params[rid],
                                                                                   tenant=rid[0])))
            w.pump()

        def hand_over(rid: str) -> None:
            (res,) = [m.reservation for m in sent if isinstance(m, P.ReserveResp) and m.reservation is not None
                      and m.reservation.request_id == rid]
            p.add_request(GenerateRequest(rid, ids[rid], params[rid], tenant=rid[0]))
            while not (ready := p.kv.take_ready()):
                p.step()
            manifest, payload = p.kv.package(ready[0], res)
            d.kv.accept(manifest, payload)
            p.kv.end_handoff(rid, None)

        def step() -> None:
            for x in d.step():
                out.setdefault(x.request_id, []).append(x)

        for rid in ("a1", "a2"):
            ask(rid)
            hand_over(rid)
        step()
        step()  # both decoding: 14 of the 16 pages and one to grow each
        scrubbed = d.pages_scrubbed
        ask("b")  # 3 pages
        granted = any(isinstance(m, P.ReserveResp) and m.reservation is not None and m.reservation.request_id == "b"
                      for m in sent)
        if fairness == "off":
            assert not granted and [q.request.request_id for q in w.queue] == ["b"]
            assert all(len(x) == 0 or x[-1].final is None for x in out.values())
            while w.queue:  # b waits for one of a's requests to end
                step()
                w.pump()
        else:
            assert granted and not w.queue  # at once: a2 (a's newest) was preempted for it
            assert d.request("a2").life.state is State.ADMITTED and d.request("a2") in d.scheduler.waiting
            assert d.pages_scrubbed > scrubbed and not d.request("a2").pages
        hand_over("b")
        while d.has_work():
            step()
            w.pump()
            d.allocator.check_integrity()
        assert_one_final_each(out)
        for rid, rid_ids in ids.items():
            assert tokens(out[rid]) == run_alone(tiny, rid_ids, params[rid]), rid
        assert d.allocator.num_free == d.pool.num_pages and p.allocator.num_free == p.pool.num_pages  # seal 8
    finally:
        w.close()


@pytest.mark.parametrize("with_b", [True, False])
def test_while_tenants_compete_a_tenant_reserves_up_to_its_fair_share(tiny: Checkpoint, with_b: bool) -> None:
    """Decode's reservations: while b competes, a's requests here stay within half the pool though pages are free
    (reserved ahead of their prefill they do no work); alone, or once b is gone, a reserves what fits."""
    cfg = EngineConfig(model=ModelConfig(max_model_len=64), cache=CacheConfig(page_size=4, pool_tokens=256),
                       scheduler=SchedulerConfig(max_num_batched_tokens=32))  # 64 pages: a's fair share 32
    w = DecodeWorker(Engine(cfg, tiny, role="decode"), "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", NO_FAULTS)
    sent: list[P.Message] = []
    w.send = lambda ident, msg: sent.append(msg)  # type: ignore[method-assign]
    try:
        def ask(rid: str, n: int) -> None:
            w.handle(b"r", P.ReserveReq(call_id=len(sent), request=GenerateRequest(rid, [5] * n, SHORT,
                                                                                   tenant=rid[0])))
            w.pump()

        def granted() -> list[str]:
            return [m.reservation.request_id for m in sent if isinstance(m, P.ReserveResp)
                    and m.reservation is not None]

        if with_b:
            ask("b1", 8)  # 2 pages
        for i in range(1, 5):
            ask(f"a{i}", 40)  # 10 pages each
        if not with_b:
            assert granted() == ["a1", "a2", "a3", "a4"]  # alone: everything that fits
            return
        assert granted() == ["b1", "a1", "a2", "a3"] and [q.request.request_id for q in w.queue] == ["a4"]
        assert w.engine.allocator.num_free >= 30  # a4 waits for its share, not for room
        w.handle(b"r", P.ReleaseReq(request_id="b1", error=ErrorInfo("X", "x", 500, "x"), rejected=True))
        w.engine.scheduler.fair.last_arrival["b"] -= 60  # b sent nothing for a minute: a is alone
        w.pump()
        assert granted()[-1] == "a4" and not w.queue
    finally:
        w.close()

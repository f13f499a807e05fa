"""The engine on a tiny random model: scheduling, preemption, chunking, sampling, and seals 1, 5, 6, 8."""

from __future__ import annotations

import time

import torch

from kvseal.engine.engine import Engine
from kvseal.errors import RequestAborted
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire.messages import GenerateDelta, GenerateRequest, SamplingParams

from .conftest import make_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def drain(engine: Engine, max_steps: int = 10_000) -> dict[str, list[GenerateDelta]]:
    out: dict[str, list[GenerateDelta]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for d in engine.step():
            out.setdefault(d.request_id, []).append(d)
    assert not engine.has_work()
    return out


def tokens(deltas: list[GenerateDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_one_final_each(out: dict[str, list[GenerateDelta]]) -> None:
    for rid, ds in out.items():
        finals = [d for d in ds if d.final is not None]
        assert len(finals) == 1 and ds[-1] is finals[0], rid  # seal 1: exactly one outcome, last


def run_alone(ck: Checkpoint, ids: list[int], params: SamplingParams = GREEDY) -> list[int]:
    e = make_engine(ck)
    e.add_request(GenerateRequest("x", ids, params))
    return tokens(drain(e)["x"])


def test_batched_and_chunked_equal_alone(tiny: Checkpoint) -> None:
    prompts = [prompt(n, i) for i, n in enumerate([3, 40, 17, 90])]
    alone = [run_alone(tiny, p) for p in prompts]
    e = make_engine(tiny, budget=16)  # forces 90- and 40-token prompts through several chunks
    for i, p in enumerate(prompts):
        e.add_request(GenerateRequest(f"r{i}", p, GREEDY))
    out = drain(e)
    assert_one_final_each(out)
    assert [tokens(out[f"r{i}"]) for i in range(4)] == alone
    assert e.allocator.num_free == e.pool.num_pages  # seal 8


def test_preemption_recomputes_and_keeps_output(tiny: Checkpoint) -> None:
    prompts = [prompt(30, 10 + i) for i in range(4)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    alone = [run_alone(tiny, p, params) for p in prompts]
    e = make_engine(tiny, pool_tokens=96, page_size=4)  # 4 x 60 tokens cannot all fit in 96
    for i, p in enumerate(prompts):
        e.add_request(GenerateRequest(f"r{i}", p, params))
    preempted = 0
    out: dict[str, list[GenerateDelta]] = {}
    while e.has_work():
        for d in e.step():
            out.setdefault(d.request_id, []).append(d)
        preempted += sum(1 for s in e.seqs.values() if s.life.history and len(s.life.history) > 3)
        e.allocator.check_integrity()
    assert preempted > 0
    assert [tokens(out[f"r{i}"]) for i in range(4)] == alone
    assert e.allocator.num_free == e.pool.num_pages


def test_context_length_rejected_before_scheduling(tiny: Checkpoint) -> None:
    e = make_engine(tiny, max_model_len=64)
    e.add_request(GenerateRequest("long", prompt(60, 1), SamplingParams(max_tokens=10, temperature=0.0)))
    out = drain(e)
    (d,) = out["long"]
    assert d.final == "rejected" and d.error is not None and d.error.code == "context_length_exceeded"
    assert d.token_ids == [] and e.allocator.num_free == e.pool.num_pages


def test_abort_frees_pages_at_once(tiny: Checkpoint) -> None:
    e = make_engine(tiny)
    e.add_request(GenerateRequest("a", prompt(20, 2), SamplingParams(max_tokens=200, temperature=0.0,
                                                                       ignore_eos=True)))
    e.step()
    e.step()
    assert e.allocator.num_free < e.pool.num_pages
    e.abort("a", RequestAborted("client went away"))
    (d,) = e.step()
    assert d.final == "aborted" and d.error is not None and d.error.code == "request_aborted"
    assert e.allocator.num_free == e.pool.num_pages and not e.has_work()


def test_wait_is_bounded_then_503(tiny: Checkpoint) -> None:
    e = make_engine(tiny, pool_tokens=64, page_size=4, wait_timeout=0.05)
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    e.add_request(GenerateRequest("a", prompt(40, 3), long))
    e.step()
    e.add_request(GenerateRequest("b", prompt(40, 4), long))
    e.step()  # b cannot get pages while a holds them
    time.sleep(0.1)
    out = drain(e)
    assert out["b"][-1].final == "rejected" and out["b"][-1].error.status == 503
    assert out["a"][-1].final == "length"
    assert e.allocator.num_free == e.pool.num_pages


def test_queueing_behind_compute_is_not_a_page_timeout(tiny: Checkpoint) -> None:
    # plenty of pages, a small token budget: later requests wait behind earlier prefills far longer than
    # wait_timeout_s, yet none was ever refused pages, so none may end 503
    e = make_engine(tiny, pool_tokens=1024, page_size=4, budget=16, wait_timeout=0.02)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i in range(6):
        e.add_request(GenerateRequest(str(i), prompt(48, 10 + i), params))
    out: dict[str, list[GenerateDelta]] = {}
    while e.has_work():
        for d in e.step():
            out.setdefault(d.request_id, []).append(d)
        time.sleep(0.01)
    assert {r: ds[-1].final for r, ds in out.items()} == {str(i): "length" for i in range(6)}


def test_seal5_foreign_page_fails_only_that_request(tiny: Checkpoint) -> None:
    e = make_engine(tiny)
    e.add_request(GenerateRequest("victim", prompt(20, 5), GREEDY))
    e.add_request(GenerateRequest("thief", prompt(20, 6), GREEDY))
    first = e.step()
    assert {d.request_id for d in first} == {"victim", "thief"}
    victim_ref = run_alone(tiny, prompt(20, 5))
    thief = e.seqs["thief"]
    thief.pages[0] = e.seqs["victim"].pages[0]  # a page table that names someone else's page
    out = drain(e)
    assert out["thief"][-1].final == "failed"
    assert out["thief"][-1].error.code == "kv_ownership_violation"
    assert all(d.token_ids == [] for d in out["thief"])  # nothing computed from the foreign page
    assert tokens(first[:1] if first[0].request_id == "victim" else first[1:]) + tokens(out["victim"]) \
        == victim_ref
    assert e.allocator.num_free == e.pool.num_pages


def test_seal5_stale_epoch_after_preemption_is_refused(tiny: Checkpoint) -> None:
    e = make_engine(tiny)
    e.add_request(GenerateRequest("r", prompt(8, 7), GREEDY))
    e.step()
    seq = e.seqs["r"]
    seq.owner = e.allocator.next_epoch(seq.owner)  # pages still carry the old epoch
    out = drain(e)
    assert out["r"][-1].final == "failed"


def test_seal6_freed_pages_are_zeroed(tiny: Checkpoint) -> None:
    def zero(e: Engine, pages: list[int]) -> bool:
        return float(e.pool.k[:, pages].abs().sum() + e.pool.v[:, pages].abs().sum()) == 0.0

    for scrub in (True, False):
        for cache in (True, False):
            e = make_engine(tiny, scrub=scrub, prefix_cache=cache)
            e.add_request(GenerateRequest("a", prompt(30, 8), SamplingParams(max_tokens=2, temperature=0.0)))
            e.step()
            pages = list(e.seqs["a"].pages)
            assert e.pool.k[:, pages].abs().sum() > 0
            drain(e)
            cached = e.allocator.cached_pages()
            assert len(cached) == (30 // 4 if cache else 0)  # the full prompt pages stay cached, read-only
            assert zero(e, [p for p in pages if p not in cached]) == scrub  # the rest: scrubbed as freed
            e.prefix_cache.clear()
            assert zero(e, pages) == scrub  # cached pages: scrubbed as evicted


def test_seeded_sampling_is_reproducible_and_independent_of_batch(tiny: Checkpoint) -> None:
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=20, seed=1234, ignore_eos=True)
    alone = run_alone(tiny, prompt(10, 9), p)
    e = make_engine(tiny)
    e.add_request(GenerateRequest("s", prompt(10, 9), p))
    e.add_request(GenerateRequest("o", prompt(12, 10), SamplingParams(max_tokens=16, temperature=1.0)))
    assert tokens(drain(e)["s"]) == alone
    other = run_alone(tiny, prompt(10, 9), SamplingParams(max_tokens=16, temperature=0.9, seed=99,
                                                          ignore_eos=True))
    assert other != alone


def test_stop_token_and_stop_string_and_logprobs(tiny: Checkpoint) -> None:
    ids = prompt(10, 11)
    free = run_alone(tiny, ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    # stop at the 5th generated token id
    stop_id = free[4]
    got = run_alone(tiny, ids, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_id,)))
    assert got == free[: free.index(stop_id) + 1]
    e = make_engine(tiny)
    text = e.tokenizer.decode(free)
    stop = text[5:7]
    e.add_request(GenerateRequest("s", ids, SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,),
                                                           ignore_eos=True, logprobs=3)))
    out = drain(e)["s"]
    assert "".join(d.text for d in out) == text[: text.find(stop)]
    assert out[-1].final == "stop"
    lps = [x for d in out if d.logprobs for x in d.logprobs]
    assert len(lps) == len(tokens(out)) and all(len(x.top) == 3 for x in lps)
    assert all(x.top[0][1] >= x.logprob - 1e-6 for x in lps)  # greedy picks the top token

"""Speculative decoding in the engine (engine/drafts.py), on tiny random models: greedy tokens equal to those without
drafts (batched, chunked, preempted, with a sliding window), one token an event, sampled tokens keep their
distribution (a fixed-seed chi-square against no speculation), drafts built from each request's own text alone while
two tenants run interleaved, a draft's rejected pages scrubbed and freed, the figures per engine. The real models'
twin: tests/e2e/test_correctness.py (exact against transformers, fast bit for bit)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest

from kvseal.config import CacheConfig, EngineConfig, SchedulerConfig
from kvseal.engine.drafts import Drafter
from kvseal.engine.engine import Engine
from kvseal.engine.lookup import Lookup, drafts_from
from kvseal.engine.speculate import MAX_DRAFT
from kvseal.kv.allocator import pages_for
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire.messages import GenerateDelta, GenerateRequest, SamplingParams

from .conftest import tiny_checkpoint
from .test_engine import drain, prompt, tokens

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def engine(ck: Checkpoint, speculative: str, pool_tokens: int = 1024, budget: int = 64, rows: int = 12,
           window_pages: bool = True, seed: int = 0) -> Engine:
    # no prefix cache: every page goes back to the free list, zeroed, when its request ends
    return Engine(EngineConfig(cache=CacheConfig(page_size=4, pool_tokens=pool_tokens, window_pages=window_pages,
                                                 prefix_cache=False),
                               scheduler=SchedulerConfig(max_num_batched_tokens=budget, speculative=speculative,
                                                         speculative_rows=rows), seed=seed), ck)


def repeating(n: int, period: int, offset: int) -> list[int]:
    """A prompt that repeats itself (as code being rewritten does): drafts have something to find."""
    return [2 + (offset + i % period * 7) % 60 for i in range(n)]


def run(e: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> dict[str, list[GenerateDelta]]:
    for i, p in enumerate(prompts):
        e.add_request(GenerateRequest(f"r{i}", p, params, tenant=f"t{i % 2}"))
    return drain(e)


@pytest.fixture(scope="module")
def windowed() -> Checkpoint:
    ck = tiny_checkpoint()
    return dataclasses.replace(ck, arch=dataclasses.replace(ck.arch, layer_windows=(8, 0)))


def wrong_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts whose last token is changed: each is partly rejected, so every step rolls back (a fake draft source)."""
    draft = Lookup.draft

    def wrong(self: Lookup, k: int) -> list[int]:
        d = draft(self, k)
        return d[:-1] + [2 + (d[-1] + 1) % 60] if d else d

    monkeypatch.setattr(Lookup, "draft", wrong)


@pytest.mark.parametrize("drafts", ["lookup", "wrong_tail"])
@pytest.mark.parametrize("case", ["alone", "batched", "chunked", "preempted", "window"])
def test_drafts_give_the_greedy_tokens_of_decoding_without_them(case: str, drafts: str, windowed: Checkpoint,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    ck = windowed if case == "window" else tiny_checkpoint()
    prompts = [repeating(30, 5, 0)] if case == "alone" else [repeating(30 + 3 * i, 4 + i, i) for i in range(4)]
    kw = {"chunked": {"budget": 16, "rows": 16}, "preempted": {"pool_tokens": 96}}.get(case, {})
    base = run(engine(ck, "off", **kw), prompts)  # type: ignore[arg-type]
    if drafts == "wrong_tail":
        wrong_tail(monkeypatch)
    e = engine(ck, "lookup", **kw)  # type: ignore[arg-type]
    for i, p in enumerate(prompts):
        e.add_request(GenerateRequest(f"r{i}", p, GREEDY, tenant=f"t{i % 2}"))
    out: dict[str, list[GenerateDelta]] = {}
    for _ in range(5000):
        if not e.has_work():
            break
        for d in e.step():
            out.setdefault(d.request_id, []).append(d)
        # between steps a decoding request holds the pages of its computed positions, no more: a rejected draft's
        # pages were scrubbed and freed at once (seal 6), not kept until the request ends
        assert all(len(s.pages) == pages_for(s.num_computed, 4) for s in e.scheduler.running
                   if s.num_tokens - s.num_computed == 1)
    assert not e.has_work()
    for rid, deltas in base.items():
        assert tokens(out[rid]) == tokens(deltas), rid
        # a stream shows one token an event, however many a step accepted: packet sizes do not tell acceptance
        assert all(len(d.token_ids) == 1 for d in out[rid] if d.final is None), rid
    if drafts == "wrong_tail":
        assert e.drafter.drafted > e.drafter.accepted  # rolled back: the rejected positions were rewritten
    else:
        assert e.drafter.accepted > 0
    e.allocator.check_integrity()
    assert e.allocator.num_free == e.pool.num_pages and e.allocator.num_owned == 0  # seal 8
    assert not e.pool.k.any() and not e.pool.v.any()  # seal 6: every page scrubbed, draft pages too


def test_a_step_drafts_only_when_its_rows_stay_small_and_no_prompt_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[tuple[int, int, bool]] = []  # (running, draft tokens, a prompt running or waiting) per step
    propose = Drafter.propose

    def spy(self: Drafter, waiting: list, running: list, window: int) -> None:
        propose(self, waiting, running, window)
        busy = bool(waiting) or any(s.num_tokens - s.num_computed > 1 for s in running)
        steps.append((len(running), sum(len(s.draft) for s in running), busy))

    monkeypatch.setattr(Drafter, "propose", spy)
    ck = tiny_checkpoint()
    e = engine(ck, "lookup", rows=8)
    for i in range(8):
        e.add_request(GenerateRequest(f"r{i}", repeating(20 + i, 4, i), GREEDY))
    drain(e)
    assert e.drafter.drafted > 0  # as requests ended, the rows left room
    assert all(n + k <= 8 for n, k, _ in steps)  # decode rows and drafts within speculative_rows
    assert all(k == 0 for n, k, busy in steps if busy or n >= 8)  # eight decoding, or a prompt: no draft
    off = engine(ck, "lookup", rows=8)
    run(off, [repeating(20, 4, 0)], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                    speculative=False))
    assert off.drafter.drafted == 0  # the request said speculative: false
    seeded = engine(ck, "lookup", rows=8)
    run(seeded, [repeating(20, 4, 0)], SamplingParams(max_tokens=40, temperature=0.7, seed=5, ignore_eos=True))
    assert seeded.drafter.drafted == 0  # its tokens must not depend on what shares its batch: whether it drafts would


def test_drafts_are_built_from_each_requests_own_text_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tenants' requests run interleaved, step by step (sampled: their outputs differ); each draft either saw is
    reproduced from its own prompt and output alone (engine/lookup.drafts_from). An index shared between requests, as
    llama.cpp's ngram-mod pool is, offers one request the other's tokens."""
    ck = tiny_checkpoint()
    e = engine(ck, "lookup")
    prompts = [prompt(40, 3), prompt(40, 4)]
    seen: list[tuple[str, int, list[int]]] = []
    propose = Drafter.propose

    def spy(self: Drafter, waiting: list, running: list, window: int) -> None:
        propose(self, waiting, running, window)
        seen.extend((s.request_id, len(s.output_ids), list(s.draft)) for s in running if s.draft)

    monkeypatch.setattr(Drafter, "propose", spy)
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=80, temperature=0.8, ignore_eos=True)  # seeds drawn by the engine
        e.add_request(GenerateRequest(f"r{i}", p, params, tenant=("acme", "globex")[i]))
    out = drain(e)
    assert Counter(rid for rid, _, _ in seen).keys() == {"r0", "r1"} and len(seen) > 40
    for rid, n_out, draft in seen:
        p = prompts[int(rid[1])]
        own = drafts_from(p + tokens(out[rid]), len(p), MAX_DRAFT)[n_out]
        assert draft == own[: len(draft)], (rid, n_out, draft, own)


def _chi2_critical(df: int) -> float:
    """The chi-square quantile at p = 0.001 (Wilson-Hilferty)."""
    z = 3.090
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_tokens_keep_their_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fixed seeds (the engine's: a request with a seed of its own never drafts): the second and third tokens of 600
    sampled requests with drafts against 600 without, a two-sample chi-square over the tokens seen (rare ones
    pooled). The draft is the second token seen most often without drafts (a fake draft source: the tiny model at
    temperature 1 repeats little), so it is often accepted and often not."""
    ck = tiny_checkpoint()
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    text = prompt(12, 4)  # the tiny model spreads its next tokens after this one (most likely: about a third)
    counts: dict[str, Counter[tuple[int, int]]] = {}
    e = engine(ck, "off")
    for spec, seed0 in (("off", 0), ("lookup", 10_000)):
        if spec == "lookup":
            likely = max((t for pos, t in counts["off"] if pos == 1), key=lambda t: counts["off"][(1, t)])
            monkeypatch.setattr(Lookup, "draft", lambda self, k, d=likely: [d] * min(k, 2))
        e = engine(ck, spec, pool_tokens=4096, budget=2048, rows=2048, seed=seed0)  # 50 prompts, then 50 drafts
        counts[spec] = Counter()
        for group in range(12):  # 50 at a time: all in the batch, nothing waiting, so each step may draft
            for i in range(50):
                e.add_request(GenerateRequest(f"r{group}-{i}", text, params))
            out = drain(e)
            counts[spec] += Counter((pos, t) for ds in out.values() for pos, t in enumerate(tokens(ds)) if pos > 0)
    assert e.drafter.drafted >= 500 and 50 < e.drafter.accepted < e.drafter.drafted - 50  # kept and rejected
    keys = set(counts["off"]) | set(counts["lookup"])
    big = [k for k in keys if counts["off"][k] + counts["lookup"][k] >= 10]
    pooled = [(counts["off"][k], counts["lookup"][k]) for k in big]
    pooled.append((sum(counts["off"][k] for k in keys if k not in big),
                   sum(counts["lookup"][k] for k in keys if k not in big)))
    stat = sum((a - b) ** 2 / (a + b) for a, b in pooled if a + b)
    assert stat < _chi2_critical(len(pooled) - 1), (stat, pooled)


def test_the_figures_count_drafts_per_engine_and_the_ledger_per_request(tmp_path: object) -> None:
    from kvseal.config import LedgerConfig
    from kvseal.ledger.store import connect

    path = f"{tmp_path}/ledger.sqlite"
    ck = tiny_checkpoint()
    e = Engine(EngineConfig(cache=CacheConfig(page_size=4), ledger=LedgerConfig(path=path)), ck)
    run(e, [repeating(30, 5, 0)])
    f = e.figures()
    assert f["spec_drafted_tokens"] == e.drafter.drafted > 0 and f["spec_accepted_tokens"] == e.drafter.accepted > 0
    assert "tenants" not in str({k: v for k, v in f.items() if k.startswith("spec_")})
    e.close()
    rows = connect(path).execute("SELECT drafted, accepted FROM requests").fetchall()
    assert rows == [(e.drafter.drafted, e.drafter.accepted)]

"""Sliding-window layers keep only their window of KV pages (kvseal/kv/window.py), on a tiny random model whose first
layer slides over 8 tokens and whose second attends to everything: a long sequence holds a few window pages, every
page that leaves the window is scrubbed and freed as it leaves, both pools return to their baseline, greedy tokens
equal those of an engine that keeps every page, and a window table naming another request's page fails that request
alone (seal 5). The e2e twin (tests/e2e/test_arch_tiny.py) checks Mistral and Gemma 3 against transformers."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from kvseal.config import CacheConfig, EngineConfig, SchedulerConfig
from kvseal.engine.engine import Engine
from kvseal.kv.allocator import FREE, NotOwner, pages_for
from kvseal.kv.window import WindowPages, split_pages, split_window
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire.messages import GenerateRequest, SamplingParams

from .conftest import make_engine, tiny_checkpoint
from .test_engine import drain, prompt, tokens

WINDOW, PAGE, BUDGET = 8, 4, 16
PARAMS = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def windowed() -> Checkpoint:
    ck = tiny_checkpoint()
    return dataclasses.replace(ck, arch=dataclasses.replace(ck.arch, layer_windows=(WINDOW, 0)))


def engine(ck: Checkpoint, pool_tokens: int = 1024, max_num_seqs: int = 64, window_pages: bool = True) -> Engine:
    return Engine(EngineConfig(cache=CacheConfig(page_size=PAGE, pool_tokens=pool_tokens, window_pages=window_pages),
                               scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=BUDGET)), ck)


def keeping_every_page(ck: Checkpoint, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of an engine whose sliding layer keeps every page (--no-window-pages: one pool, the window only
    masked, as before kv/window.py)."""
    e = engine(ck, window_pages=False)
    assert e.window is None and e.model.windows == (WINDOW, 0)
    for i, p in enumerate(prompts):
        e.add_request(GenerateRequest(f"r{i}", p, PARAMS))
    out = drain(e)
    return [tokens(out[f"r{i}"]) for i in range(len(prompts))]


def at_baseline(e: Engine) -> bool:
    assert e.window is not None
    e.allocator.check_integrity()
    e.window.allocator.check_integrity()
    return (e.allocator.num_free == e.pool.num_pages and e.window.allocator.num_free == e.window.pool.num_pages
            and not e.window.pool.k.any() and not e.window.pool.v.any())


def test_split_window() -> None:
    assert split_window((16, 0, 16, 0)) == 16 and split_window((16, 16)) == 16
    assert split_window((0, 0)) == 0 and split_window((16, 32)) == 0  # nothing slides / two windows: not split



@pytest.mark.parametrize("full, slid, window, seqs, budget, pages", [
    (3, 15, 512, 64, 512, 4096),  # Gemma 3 270M's layers with the default pool (2 x 32768 tokens): 3.3x positions
    (1, 1, 8, 64, 16, 32),  # a window pool wanted larger than the whole pool: the pool as it was, split in two
    (2, 2, 16, 4, 32, 1000)])
def test_the_split_keeps_the_configured_bytes_and_never_fewer_positions(
        full: int, slid: int, window: int, seqs: int, budget: int, pages: int) -> None:
    most = 10**6
    main, wpages = split_pages(pages, full, slid, window, 16, seqs, budget, most)
    assert main * full + wpages * slid <= pages * (full + slid)  # no more memory than one pool of every layer
    assert main >= pages and wpages <= main
    # what the running sequences can hold at once fits, or the window pool is as large as the pool was
    assert wpages == min(pages, seqs * (pages_for(window - 1, 16) + 2) + pages_for(budget, 16))
    if full == 3:
        assert (main, wpages) == (13536, 2208)
    assert split_pages(pages, 0, full + slid, window, 16, seqs, budget, most)[0] == most  # Mistral: no full layer


def test_a_long_sequence_keeps_only_its_window_and_each_dropped_page_is_scrubbed_and_freed(
        windowed: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = prompt(50, 1)
    # every page the window pool frees here is one that left the window (a draft's rejected pages are freed too:
    # tests/unit/test_spec_engine.py has windows with speculation)
    e = make_engine(windowed, page_size=PAGE, budget=BUDGET, speculative="off")
    w = e.window
    assert w is not None and w.layers == (0,) and w.full_layers == (1,)
    assert e.pool.k.shape[0] == 1 and w.pool.k.shape[0] == 1  # each layer's KV in one pool only
    e.add_request(GenerateRequest("x", ids, PARAMS))
    freed: list[tuple[int, bool]] = []  # (page, held KV when freed) for every page the window pool freed
    free = w.allocator.free

    def spy(owner: object, pages: list[int]) -> None:
        freed.extend((p, bool(w.pool.k[:, p].any())) for p in pages)
        free(owner, pages)  # type: ignore[arg-type]

    monkeypatch.setattr(w.allocator, "free", spy)
    out: list = []
    held_most = 0
    while e.has_work():
        seen = len(freed)
        out += e.step()
        for p, held in freed[seen:]:  # dropped in this step: free and zero at once, not when the request ends
            assert held and w.allocator.owner_of(p) == (FREE, FREE)
            assert not w.pool.k[:, p].any() and not w.pool.v[:, p].any(), f"page {p} was not scrubbed"
        seq = e.request("x")
        if seq is None:
            break
        held_most = max(held_most, len(seq.window_pages))
        # what the next query can see, plus the page being filled; a prompt chunk may add BUDGET tokens more
        assert len(seq.window_pages) <= pages_for(WINDOW - 1 + BUDGET, PAGE) + 1
        assert seq.window_base == max(0, seq.num_computed - WINDOW + 1) // PAGE
        if seq.num_computed > len(ids):  # decoding: the window and the page being written
            assert len(seq.window_pages) <= pages_for(WINDOW, PAGE) + 1
            assert len(seq.pages) == pages_for(seq.num_computed, PAGE)  # the full layer keeps every position
    dropped = [p for p, _ in freed]
    total = len(ids) + PARAMS.max_tokens
    # the last step computed total - 1 positions: every page before the next query's window went as it left
    assert len(dropped) == e.info()["window_pool"]["dropped_pages"] == (total - 1 - WINDOW + 1) // PAGE
    assert held_most < pages_for(total, PAGE) // 3
    assert tokens([d for d in out if d.request_id == "x"]) == keeping_every_page(windowed, [ids])[0]
    assert at_baseline(e)  # seal 8: both pools' pages back, the window pool all zero (seal 6)


def test_batched_chunked_and_preempted_windows_equal_keeping_every_page(
        windowed: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [prompt(n, i) for i, n in enumerate([3, 40, 17, 90])]
    expected = keeping_every_page(windowed, prompts)
    # 128 tokens and 4 sequences at most: a window pool of 4 x 4 + 4 pages (what they can hold at once), a main pool
    # of 44 pages (the bytes left), where the 90-token prompt and the others preempt each other
    for pool_tokens, seqs in ((1024, 64), (128, 4)):
        e = engine(windowed, pool_tokens=pool_tokens, max_num_seqs=seqs)
        preempted: list[str] = []
        preempt = e.scheduler._preempt
        monkeypatch.setattr(e.scheduler, "_preempt",
                            lambda s, log=preempted, f=preempt: (log.append(s.request_id), f(s)))
        for i, p in enumerate(prompts):
            e.add_request(GenerateRequest(f"r{i}", p, PARAMS))
        out = drain(e)
        assert bool(preempted) == (pool_tokens == 128)
        assert e.window is not None and (e.pool.num_pages, e.window.pool.num_pages) == ((256, 256) if seqs == 64
                                                                                         else (44, 20))
        assert [tokens(out[f"r{i}"]) for i in range(4)] == expected, pool_tokens
        assert at_baseline(e)


def test_seal5_a_window_table_naming_another_requests_page_fails_only_that_request(windowed: Checkpoint) -> None:
    a_ids, b_ids = prompt(30, 2), prompt(30, 3)
    e = make_engine(windowed, page_size=PAGE, budget=64)
    e.add_request(GenerateRequest("a", a_ids, PARAMS))
    e.add_request(GenerateRequest("b", b_ids, PARAMS))
    out = [d for _ in range(3) for d in e.step()]  # both prefilled and decoding
    a, b = e.request("a"), e.request("b")
    assert a.window_pages and b.window_pages and not set(a.window_pages) & set(b.window_pages)
    a.window_pages[-1] = b.window_pages[-1]  # a's sliding layer would read (and write) b's KV
    while e.has_work():
        out += e.step()
    finals = {d.request_id: d for d in out if d.final is not None}
    assert finals["a"].final == "failed" and finals["a"].error is not None
    assert finals["a"].error.code == "kv_ownership_violation" and e.ownership_violations == 1
    assert finals["b"].final == "length"
    assert tokens([d for d in out if d.request_id == "b"]) == keeping_every_page(windowed, [b_ids])[0]
    assert at_baseline(e)


def test_a_drop_of_pages_not_owned_is_refused_and_changes_nothing(windowed: Checkpoint) -> None:
    arch = windowed.arch
    w = WindowPages(arch, (WINDOW, 0), 16, PAGE, torch.float32, torch.device("cpu"), scrub=lambda pages: None)
    owners = [w.allocator.new_owner(), w.allocator.new_owner()]
    a, b = (SimpleNamespace(owner=o, window_pages=[], window_base=0, num_computed=0) for o in owners)
    assert w.grow(a, 20) and w.grow(b, 20) and len(a.window_pages) == 5  # type: ignore[arg-type]
    w.pool.k[:, b.window_pages] = 1.0
    a.window_pages[0] = b.window_pages[0]
    a.num_computed = 20
    with pytest.raises(NotOwner):
        w.drop(a)  # type: ignore[arg-type]
    assert a.window_base == 0 and len(a.window_pages) == 5 and w.allocator.owns(b.owner, b.window_pages)
    assert bool(w.pool.k[:, b.window_pages].all()) and w.pages_dropped == 0
    w.allocator.check_integrity()


def test_a_sequence_the_window_pool_cannot_take_now_holds_no_main_page_while_it_waits(windowed: Checkpoint) -> None:
    e = engine(windowed)
    w = e.window
    assert w is not None
    squatter = w.allocator.new_owner()
    held = w.allocator.allocate(squatter, w.allocator.num_free)  # the window pool is full
    e.add_request(GenerateRequest("x", prompt(20, 4), PARAMS))
    for _ in range(3):
        assert e.step() == []
    seq = e.request("x")
    assert seq in e.scheduler.waiting and not seq.pages and not seq.window_pages
    assert e.allocator.num_free == e.pool.num_pages  # nothing half-held in the main pool
    w.allocator.free(squatter, held)
    out = drain(e)
    assert out["x"][-1].final == "length" and tokens(out["x"]) == keeping_every_page(windowed, [prompt(20, 4)])[0]
    assert at_baseline(e)

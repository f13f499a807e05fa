"""The prefix cache inside the engine (tiny random model): hits within a tenant, none across tenants or
cache_salts (seal 9), the same greedy tokens with and without a hit, seal 5 for cached pages, and pools that
return to baseline (seal 8) with cached pages counted as free."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from kvseal.engine.engine import Engine
from kvseal.kv.prefix_cache import namespace_root
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire.messages import GenerateRequest, SamplingParams
from tests.helpers.halves import decode_engine, prefill_engine

from .conftest import make_engine
from .test_engine import GREEDY, drain, prompt, tokens

PS = 4


def run(e: Engine, rid: str, ids: list[int], tenant: str = "", salt: str | None = None,
        params: SamplingParams = GREEDY) -> tuple[list[int], int, list[int]]:
    """Run one request to the end; its tokens, its cached_tokens and the pages it read."""
    e.add_request(GenerateRequest(rid, ids, params, tenant=tenant, cache_salt=salt))
    out = e.step()
    pages = list(e.seqs[rid].pages) if rid in e.seqs else []
    out += drain(e).get(rid, [])
    e.allocator.check_integrity()
    return tokens(out), out[-1].cached_tokens, pages


def test_same_tenant_hits_and_output_is_unchanged(tiny: Checkpoint) -> None:
    shared = prompt(37, 1)
    base = make_engine(tiny, prefix_cache=False)
    e = make_engine(tiny)
    for i, suffix in enumerate([[], prompt(9, 2), prompt(3, 3)]):
        ids = shared + suffix
        ref, ref_cached, _ = run(base, f"b{i}", ids)
        got, cached, _ = run(e, f"r{i}", ids)
        assert got == ref and ref_cached == 0  # the same greedy tokens, hit or not
        assert cached == (0 if i == 0 else 36)  # 9 full pages of the shared 37 tokens
    assert e.info()["prefix_cache_hit_tokens"] == 72
    assert e.allocator.num_free == e.pool.num_pages and e.prefix_cache.num_referenced == 0  # seal 8


def test_the_last_prompt_token_is_always_computed(tiny: Checkpoint) -> None:
    e = make_engine(tiny)
    ids = prompt(16, 4)  # exactly four pages
    run(e, "a", ids)
    got, cached, _ = run(e, "b", ids)
    assert cached == 12  # three pages: the fourth holds the last token, whose logits give the first output
    assert got == run(make_engine(tiny, prefix_cache=False), "c", ids)[0]


def test_tenants_and_salts_never_share(tiny: Checkpoint) -> None:
    e = make_engine(tiny)
    ids = prompt(40, 5)
    _, first_cached, first_pages = run(e, "a1", ids, tenant="alice")
    assert first_cached == 0
    for rid, tenant, salt in (("b1", "bob", None), ("a2", "alice", "s1"), ("a3", "alice", "s2")):
        _, cached, pages = run(e, rid, ids, tenant=tenant, salt=salt)
        assert cached == 0 and not set(pages) & set(first_pages), rid
    _, cached, pages = run(e, "a4", ids, tenant="alice")
    assert cached == 36 and pages[:9] == first_pages[:9]  # alice again, no salt: a hit, the same pages
    _, cached, _ = run(e, "a5", ids, tenant="alice", salt="s1")
    assert cached == 36  # a salt is a namespace of its own, and hits within it


def test_seal5_another_tenants_cached_page_is_refused(tiny: Checkpoint) -> None:
    e = make_engine(tiny)
    ids = prompt(24, 6)
    run(e, "alice", ids, tenant="alice")
    alice_pages = e.allocator.cached_pages()
    assert alice_pages
    e.add_request(GenerateRequest("bob", ids, GREEDY, tenant="bob"))
    e.add_request(GenerateRequest("carol", prompt(24, 7), GREEDY, tenant="carol"))
    first = e.step()
    bob = e.seqs["bob"]
    assert not set(bob.pages) & set(alice_pages)
    bob.pages[0] = alice_pages[0]  # a table that names alice's cached page (a refcount or lookup bug)
    out = drain(e)
    assert out["bob"][-1].final == "failed" and out["bob"][-1].error.code == "kv_ownership_violation"
    assert all(d.token_ids == [] for d in out["bob"])  # nothing computed from alice's KV
    assert out["carol"][-1].final == "length" and next(d for d in first if d.request_id == "bob").token_ids
    assert e.allocator.num_free == e.pool.num_pages
    e.allocator.check_integrity()


def test_seal5_a_cached_page_not_acquired_is_refused_even_within_the_tenant(tiny: Checkpoint) -> None:
    e = make_engine(tiny)
    ids = prompt(24, 8)
    run(e, "a", ids, tenant="t")
    e.add_request(GenerateRequest("b", prompt(24, 9), GREEDY, tenant="t"))
    e.step()
    e.seqs["b"].pages[1] = e.allocator.cached_pages()[0]  # its tenant's, but never acquired: no reference
    assert drain(e)["b"][-1].final == "failed"


def test_seal5_a_step_that_would_write_into_a_cached_page_is_refused(tiny: Checkpoint) -> None:
    e = make_engine(tiny)
    ids = prompt(24, 14)
    run(e, "a", ids, tenant="t")
    e.add_request(GenerateRequest("b", ids, GREEDY, tenant="t"))
    first = e.step()  # b: five pages from the cache, the sixth computed, the first token sampled
    b = e.seqs["b"]
    assert first[0].cached_tokens == 20 and len(b.pages) == 6
    b.pages.append(b.pages[0])  # the page for its next token: a cached page it legitimately holds
    out = drain(e)["b"]
    assert out[-1].final == "failed" and out[-1].error.code == "kv_ownership_violation"
    assert all(d.token_ids == [] for d in out)
    assert run(e, "c", ids, tenant="t")[0] == run(make_engine(tiny, prefix_cache=False), "d", ids)[0]  # intact


def test_preemption_releases_references_and_reuses_the_cache(tiny: Checkpoint) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    shared = prompt(24, 10)
    prompts = [shared + prompt(6, 11 + i) for i in range(4)]
    alone = [run(make_engine(tiny, prefix_cache=False), "x", p, params=params)[0] for p in prompts]
    e = make_engine(tiny, pool_tokens=96)  # 4 x 60 tokens cannot all fit in 96: preemption
    run(e, "warm", shared, params=SamplingParams(max_tokens=1, temperature=0.0))
    for i, p in enumerate(prompts):
        e.add_request(GenerateRequest(f"r{i}", p, params))
    out: dict[str, list] = {}
    preempted = 0
    while e.has_work():
        for d in e.step():
            out.setdefault(d.request_id, []).append(d)
        preempted += sum(1 for s in e.seqs.values() if len(s.life.history) > 3)
        e.allocator.check_integrity()
    assert preempted > 0
    assert [tokens(out[f"r{i}"]) for i in range(4)] == alone
    assert all(out[f"r{i}"][-1].cached_tokens == 24 for i in range(4))
    assert e.allocator.num_free == e.pool.num_pages and e.prefix_cache.num_referenced == 0


def test_no_prefix_cache_caches_nothing(tiny: Checkpoint) -> None:
    e = make_engine(tiny, prefix_cache=False)
    ids = prompt(30, 12)
    run(e, "a", ids)
    assert run(e, "b", ids)[1] == 0 and e.allocator.num_cached == 0 and e.info()["prefix_cache"] is False


@pytest.mark.parametrize("hit", [False, True])
def test_prefill_engine_caches_and_ships_the_whole_prompt(tiny: Checkpoint, hit: bool) -> None:
    from kvseal.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    cfg = EngineConfig(model=ModelConfig(max_model_len=256), cache=CacheConfig(page_size=PS, pool_tokens=512),
                       scheduler=SchedulerConfig(max_num_batched_tokens=64))
    p, d = prefill_engine(cfg, tiny), decode_engine(cfg, tiny)
    ids = prompt(41, 13)
    ref = run(make_engine(tiny, prefix_cache=False), "ref", ids)[0]
    rounds = ["warm", "r"] if hit else ["r"]
    for rid in rounds:
        res = d.kv.reserve(GenerateRequest(rid, ids, GREEDY), 60.0, "tcp://test")
        p.add_request(GenerateRequest(rid, ids, GREEDY))
        while not (ready := p.kv.take_ready()):
            p.step()
        (h,) = ready
        # the whole prompt ships, cached pages included
        assert h.handoff is not None and h.handoff.num_pages == 11 and len(h.pages) == 11
        manifest, payload = p.kv.package(h, res)
        d.kv.accept(manifest, payload)
        p.kv.end_handoff(rid, None)
        out = drain(d)[rid]
        assert tokens(out) == ref
    assert p.info()["prefix_cache_hit_tokens"] == (40 if hit else 0)
    assert p.allocator.num_free == p.pool.num_pages and d.allocator.num_free == d.pool.num_pages
    assert p.allocator.num_cached == 10 and d.allocator.num_cached == 0  # decode keeps no cache
    p.allocator.check_integrity()
    d.allocator.check_integrity()


ONE = SamplingParams(max_tokens=1, temperature=0.0)  # the prefix hit is all these tests look at
_NAMES = st.text(alphabet="ab:\x00\x01|-", max_size=6)  # short, and rich in what a naive join would confuse


def test_cache_salt_only_splits_a_tenants_cache_never_reaches_another(tiny: Checkpoint) -> None:
    """Issue 17: cache_salt is the client's; whatever it chooses (another tenant's name, that name with separators,
    an empty salt, a tenant+salt split the other way), it never names another tenant's pages."""
    e = make_engine(tiny, pool_tokens=16384)  # room for every example's pages: no eviction, so a page id is one page
    seeds = iter(range(1000, 10**6))

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.reuse, Phase.generate])
    @given(a=_NAMES, a_salt=st.none() | _NAMES, b=_NAMES, b_salt=st.none() | _NAMES)
    def check(a: str, a_salt: str | None, b: str, b_salt: str | None) -> None:
        assume(a != b)
        crafted = {b_salt, a, a_salt, f"{a}{a_salt or ''}", f"{a_salt or ''}{a}", "", None}
        for salt in crafted:  # no (b, salt) has a's root: the namespaces are apart by construction ...
            assert namespace_root(b, salt) != namespace_root(a, a_salt), (a, a_salt, b, salt)
        ids = prompt(24, next(seeds))  # ... and in the engine: a prompt of its own per example
        _, cached, _ = run(e, f"a-{uuid.uuid4().hex}", ids, tenant=a, salt=a_salt, params=ONE)
        assert cached == 0
        a_pages = set(e.allocator.cached_pages())
        for salt in crafted:
            _, cached, b_pages = run(e, f"b-{uuid.uuid4().hex}", ids, tenant=b, salt=salt, params=ONE)
            assert cached == 0 and not set(b_pages) & a_pages, (a, a_salt, b, salt)
            a_pages |= set(e.allocator.cached_pages())  # b's own pages now too: his next salt may not hit them
        _, cached, _ = run(e, f"a-{uuid.uuid4().hex}", ids, tenant=a, salt=a_salt, params=ONE)
        assert cached == 20  # a's own namespace still hits: five full pages of 24 tokens, the last one computed

    check()
    assert e.prefix_cache.evicted_pages == 0
    assert e.allocator.num_free == e.pool.num_pages


def test_a_crafted_salt_never_reaches_another_tenants_pages(tiny: Checkpoint) -> None:
    """The named cases: bob choosing alice's tenant name (or alice's name with the root's separators) as his
    cache_salt, or an empty salt, never hits alice's cached prompt."""
    e = make_engine(tiny)
    ids = prompt(24, 12)
    run(e, "alice-1", ids, tenant="alice", params=ONE)
    run(e, "alice-2", ids, tenant="alice", salt="s", params=ONE)
    alice_pages = set(e.allocator.cached_pages())
    for i, salt in enumerate(["alice", "", "\x00alice", "alice\x00", "alices", "s", "alice\x01s"]):
        _, cached, pages = run(e, f"bob-{i}", ids, tenant="bob", salt=salt, params=ONE)
        assert cached == 0 and not set(pages) & alice_pages, salt
    for i, (tenant, salt) in enumerate([("", "alice"), ("alic", "e"), ("alice\x01", None), ("", None)]):
        _, cached, pages = run(e, f"other-{i}", ids, tenant=tenant, salt=salt, params=ONE)
        assert cached == 0 and not set(pages) & alice_pages, (tenant, salt)
    _, cached, _ = run(e, "alice-3", ids, tenant="alice", params=ONE)
    assert cached == 20

"""The cross-tenant probe's verdict from its timings (pure): shared, isolated, or no cache to see."""

from __future__ import annotations

from kvseal.audit.tenants import Trial, verdict


def trials(b_copy: float, a_again: float, cached: int | None = None, n: int = 5) -> list[Trial]:
    return [Trial(a_first_s=2.0, b_copy_s=b_copy, b_fresh_s=2.0, a_again_s=a_again, b_copy_cached=cached,
                  a_again_cached=None) for _ in range(n)]


def test_a_faster_copy_for_the_other_tenant_is_shared() -> None:
    v = verdict(trials(b_copy=0.1, a_again=0.1))
    assert v["shared"] and v["summary"].startswith("SHARED")


def test_a_reported_cache_hit_for_the_other_tenant_is_shared_whatever_the_timing() -> None:
    assert verdict(trials(b_copy=2.0, a_again=0.1, cached=64))["shared"]


def test_own_repeat_fast_and_other_tenant_not_is_isolated() -> None:
    v = verdict(trials(b_copy=2.1, a_again=0.1, cached=0))
    assert not v["shared"] and v["summary"].startswith("ISOLATED")


def test_no_speedup_anywhere_is_no_cache_seen() -> None:
    v = verdict(trials(b_copy=2.0, a_again=2.0))
    assert not v["shared"] and v["summary"].startswith("NO CACHE SEEN")


def test_one_lucky_trial_is_not_a_verdict() -> None:
    mixed = trials(b_copy=2.2, a_again=0.1, n=4) + trials(b_copy=0.5, a_again=0.1, n=1)
    assert not verdict(mixed)["shared"]

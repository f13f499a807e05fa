"""The tenant audit's prefix-cache verdict from its timings (pure), and the audit's own rules: probe names, exit
codes, and keys that never reach the report."""

from __future__ import annotations

import random

from kvseal.audit.tenant_probes.common import redact
from kvseal.audit.tenant_probes.prefix_cache import Trial, judge, prompt_text
from kvseal.audit.tenants import exit_code, parse_keys, parse_probes


def trials(b_copy: float, a_again: float, b_cached: int | None = None, a_cached: int | None = None,
           n: int = 5) -> list[Trial]:
    return [Trial(a_first_s=2.0, b_copy_s=b_copy, b_fresh_s=2.0, a_again_s=a_again, b_copy_cached=b_cached,
                  a_again_cached=a_cached) for _ in range(n)]


def test_a_faster_copy_for_the_other_tenant_is_broken() -> None:
    verdict, summary, figures = judge(trials(b_copy=0.1, a_again=0.1))
    assert verdict == "broken" and summary.startswith("SHARED") and figures["cross_hit_by_timing"]


def test_a_reported_cache_hit_for_the_other_tenant_is_broken_whatever_the_timing() -> None:
    verdict, _, figures = judge(trials(b_copy=2.0, a_again=2.0, b_cached=64))
    assert verdict == "broken" and figures["cross_hit_by_cached_tokens"] and not figures["control_hit"]


def test_own_repeat_fast_and_other_tenant_not_is_held() -> None:
    verdict, summary, _ = judge(trials(b_copy=2.1, a_again=0.1, b_cached=0))
    assert verdict == "held" and summary.startswith("ISOLATED")


def test_a_control_hit_by_cached_tokens_alone_is_enough_to_hold() -> None:
    assert judge(trials(b_copy=2.0, a_again=2.0, b_cached=0, a_cached=320))[0] == "held"


def test_no_hit_anywhere_is_not_applicable_never_held() -> None:
    verdict, summary, figures = judge(trials(b_copy=2.0, a_again=2.0, b_cached=0, a_cached=0))
    assert verdict == "not_applicable" and summary.startswith("NO CACHE SEEN") and not figures["control_hit"]


def test_one_lucky_trial_is_not_a_verdict() -> None:
    mixed = trials(b_copy=2.2, a_again=0.1, n=4) + trials(b_copy=0.5, a_again=0.1, n=1)
    assert judge(mixed)[0] == "held"


def test_noise_far_from_the_controls_saving_is_not_a_cross_hit() -> None:
    # A's repeat takes 0.05x: a shared cache would serve B's copy about as fast. 0.76x (a busy machine's noise,
    # measured on kvseal) saves less than half of that, so it does not count ...
    assert judge(trials(b_copy=1.52, a_again=0.1))[0] == "held"
    # ... while the same 0.76x with no working control to compare with still does
    assert judge(trials(b_copy=1.52, a_again=2.0))[0] == "broken"


def test_keys_and_probe_names_are_checked() -> None:
    assert parse_keys("ka, kb") == ("ka", "kb")
    assert parse_keys("ka,ka") is None and parse_keys("ka") is None and parse_keys("ka,,kb") is None
    assert parse_probes(None) == ("prefix_cache", "stored_responses", "status_pages", "noisy_neighbour")
    assert parse_probes("noisy-neighbour,prefix_cache") == ("prefix_cache", "noisy_neighbour")  # the audit's order
    assert parse_probes("prefix_cache,nosuch") is None and parse_probes(",") is None


def test_broken_wins_over_could_not_run() -> None:
    assert exit_code(["held", "not_applicable"]) == 0
    assert exit_code(["held", "error"]) == 2
    assert exit_code(["error", "broken", "held"]) == 1


def test_keys_are_redacted_everywhere_in_a_report() -> None:
    keys = {"A": "sk-alpha-123", "B": "sk-beta-456"}
    report = {"summary": "saw sk-alpha-123 in /metrics", "evidence": {"sk-beta-456": ["x sk-beta-456 y", 3]}}
    out = redact(report, keys)
    assert out == {"summary": "saw <key A> in /metrics", "evidence": {"<key B>": ["x <key B> y", 3]}}
    assert "sk-" not in str(out)


def test_the_same_seed_twice_still_sends_fresh_prompts() -> None:
    # a second run against a warm cache (vLLM reports no cached_tokens) would time a hit as A's "first" send
    first, again = (prompt_text(300, random.Random(1), run) for run in ("1a2b3c4d", "5e6f7a8b"))
    assert first[:16] != again[:16] and first[22:] == again[22:]  # the seed still fixes the prose

"""The verdicts of the stored-responses, noisy-neighbour and status-pages tenant probes, from made-up
observations (pure: no server)."""

from __future__ import annotations

from typing import Any

from kvseal.audit.tenant_probes import noisy_neighbour, status_pages, stored_responses
from kvseal.audit.tenant_probes.noisy_neighbour import Sample

# -- stored responses ----------------------------------------------------------------------------------------


def seen(**changes: int) -> dict[str, Any]:
    base = {"a_get": 200, "b_get": 404, "b_get_made_up": 404, "b_continue": 404, "b_delete": 404,
            "a_get_after": 200}
    return {**base, **changes}


def test_404s_for_b_and_a_still_reading_is_held() -> None:
    verdict, summary = stored_responses.judge(seen())
    assert verdict == "held" and "exactly as for a made-up id" in summary


def test_b_reading_continuing_or_deleting_is_broken_each_alone() -> None:
    for step in ("b_get", "b_continue", "b_delete"):
        assert stored_responses.judge(seen(**{step: 200}))[0] == "broken", step
    assert "continued it" in stored_responses.judge(seen(b_continue=200))[1]


def test_a_losing_its_response_after_bs_delete_is_broken() -> None:
    verdict, summary = stored_responses.judge(seen(b_delete=404, a_get_after=404))
    assert verdict == "broken" and "B's DELETE removed it" in summary


def test_a_different_refusal_for_a_real_id_is_held_but_said() -> None:
    verdict, summary = stored_responses.judge(seen(b_get=403, b_continue=403, b_delete=403))
    assert verdict == "held" and "B can tell which ids exist" in summary


# -- noisy neighbour -----------------------------------------------------------------------------------------


def samples(*latencies: float, status: int | None = 200) -> list[Sample]:
    return [Sample(s, status, None if status == 200 else "overloaded") for s in latencies]


def test_b_keeping_its_latency_under_the_flood_is_held() -> None:
    verdict, _, figures = noisy_neighbour.judge(samples(0.1, 0.1, 0.2), samples(0.15, 0.3, 0.35))
    assert verdict == "held" and figures["p99_bound_s"] == 1.2  # alone p99 0.2 s + 1 s beats 2 x 0.2 s


def test_a_p99_over_both_bounds_is_broken() -> None:
    verdict, summary, figures = noisy_neighbour.judge(samples(0.1, 0.1, 0.2), samples(0.15, 0.3, 1.5))
    assert verdict == "broken" and figures["b_flooded_p99_s"] == 1.5 and "slows B down" in summary


def test_the_bound_is_twice_a_slow_alone_p99() -> None:
    alone = samples(2.0, 3.0)
    assert noisy_neighbour.judge(alone, samples(5.9))[0] == "held"  # bound 6 s, not 4 s
    assert noisy_neighbour.judge(alone, samples(6.1))[0] == "broken"


def test_any_error_for_b_under_the_flood_is_broken_however_fast() -> None:
    flooded = samples(0.1, 0.1) + samples(0.01, status=429) + samples(0.5, status=None)
    verdict, summary, figures = noisy_neighbour.judge(samples(0.1, 0.1), flooded)
    assert verdict == "broken" and figures["b_flooded_errors"] == 2 and "2 of 4" in summary


# -- status pages --------------------------------------------------------------------------------------------

A_IDS = {"A's key": "sk-alpha-123", "a sha256 of A's key": "0123456789abcdef", "A's tenant name": "alice"}
CANARY = "K7QX4M2P"


def view(text: str, status: int = 200) -> dict[str, Any]:
    return {"status": status, "text": text}


def judge(**views: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    return status_pages.judge({"/" + k: v for k, v in views.items()}, A_IDS, CANARY, "bob")


def test_b_seeing_only_itself_and_fleet_totals_is_held() -> None:
    metrics = 'kvseal:tenant_ttft_count{tenant="bob"} 3\nvllm:num_requests_running{model_name="m"} 2\n'
    verdict, _, findings = judge(metrics=view(metrics), info=view('{"tenant": "bob", "requests": {"completed": 3}}'))
    assert verdict == "held" and findings == {}


def test_another_tenants_label_is_broken() -> None:
    metrics = 'kvseal:tenant_ttft_count{tenant="bob"} 3\nkvseal:tenant_ttft_count{tenant="carol"} 9\n'
    verdict, _, findings = judge(metrics=view(metrics))
    assert verdict == "broken" and "carol" in findings["/metrics"][0]


def test_as_name_key_hash_or_canary_in_any_page_is_broken() -> None:
    for text, what in (('{"tenant": "alice"}', "A's tenant name"), ("x sk-alpha-123 y", "A's key"),
                       ('key_hash="0123456789ABCDEF00"', "a sha256 of A's key"),
                       ('{"slots": [{"prompt": "My account code is K7QX4M2P."}]}', "A's canary")):
        verdict, _, findings = judge(slots=view(text))
        assert verdict == "broken" and any(f.startswith(what) for f in findings["/slots"]), text


def test_a_tenant_name_inside_another_word_is_not_a_match() -> None:
    assert judge(info=view('{"note": "malice and palaces"}'))[0] == "held"


def test_per_tenant_maps_in_json_are_other_tenants() -> None:
    verdict, _, findings = judge(info=view('{"tenants": {"bob": {"n": 1}, "dave": {"n": 4}}}'))
    assert verdict == "broken" and "dave" in findings["/info"][0]


def test_refused_pages_hold_and_missing_ones_are_not_applicable() -> None:
    assert judge(metrics=view("forbidden sk-alpha-123", 403), info=view("", 401))[0] == "held"  # not read
    assert judge(metrics=view("", 404), info=view("", 404))[0] == "not_applicable"


def test_without_bs_own_name_one_label_is_not_enough_but_two_are() -> None:
    one = view('x{tenant="t1"} 1\n')
    two = view('x{tenant="t1"} 1\nx{tenant="t2"} 1\n')
    assert status_pages.judge({"/metrics": one}, {}, CANARY, None)[0] == "held"
    assert status_pages.judge({"/metrics": two}, {}, CANARY, None)[0] == "broken"


def test_samples_that_moved_are_listed() -> None:
    before = "# HELP a x\na_total 1\nb_total{tenant=\"bob\"} 2\n"
    after = "# HELP a x\na_total 3\nb_total{tenant=\"bob\"} 2\n"
    assert status_pages.moved(before, after) == ["a_total"]

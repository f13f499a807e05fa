"""The audit's pure parts: secrets, prompts, leak detection, error-body checks, the plan, and the verdict."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvseal.audit.canary import (
    ALPHABET_DIGITS,
    ALPHABET_LETTERS,
    SECRET_LEN,
    RequestSpec,
    Sizing,
    build_plan,
    contains_secret,
    error_problem,
    filler,
    find_foreign_secrets,
    make_secrets,
    request_body,
    sizing_from_calibration,
)
from kvseal.audit.report import build_report, find_violations, quantile
from kvseal.audit.runner import Result


def test_secrets_are_unique_and_well_formed() -> None:
    secrets = make_secrets(5000, random.Random(1))
    assert len(set(secrets)) == 5000
    for s in secrets:
        assert len(s) == SECRET_LEN and set(s) <= set(ALPHABET_LETTERS + ALPHABET_DIGITS)
        letters = sum(c in ALPHABET_LETTERS for c in s)
        assert 2 <= letters <= SECRET_LEN - 2  # mixed, so it splits into several tokens
    assert make_secrets(10, random.Random(7)) == make_secrets(10, random.Random(7))


def _text_of(body: dict[str, object]) -> str:
    if "messages" in body:
        return "\n".join(m["content"] for m in body["messages"])  # type: ignore[attr-defined, index]
    return str(body["prompt"])


def test_prompt_contains_its_secret_and_grows_with_the_target() -> None:
    sizing = Sizing(window=4096, max_tokens=24, fit_cpt=4.0, over_cpt=5.0)
    for endpoint in ("chat", "completion"):
        sizes = []
        for tokens in (10, 500, 3000):
            spec = RequestSpec(3, endpoint, False, "AB23CD45", tokens)  # type: ignore[arg-type]
            body = request_body(spec, sizing, "m", seed=1)
            text = _text_of(body)
            assert "AB23CD45" in text
            assert body["temperature"] == 0 and body["max_tokens"] == 24 and body["model"] == "m"
            sizes.append(len(text))
            assert request_body(spec, sizing, "m", seed=1) == body  # replayable
        assert sizes[0] < sizes[1] < sizes[2] and sizes[2] >= 3000 * 4
    # the completion prompt ends in a pattern that continues with the secret
    body = request_body(RequestSpec(0, "completion", True, "ZZ99YY88", 50), sizing, "m", 1)
    assert str(body["prompt"]).endswith("code: ZZ99YY88\ncode:") and body["stream"] is True


def test_filler_repeats_the_secret_through_the_prompt() -> None:
    text = filler(5000, "QW34ER56", random.Random(0))
    assert len(text) == 5000 and text.count("QW34ER56") >= 8
    assert not any(c.isdigit() for c in filler(5000, None, random.Random(0)))


def test_leak_detection_finds_another_requests_secret_and_ignores_its_own() -> None:
    pool = frozenset({"AB23CD45", "XY67ZW89", "PQ23RS45"})
    assert find_foreign_secrets("AB23CD45 AB23CD45", "AB23CD45", pool) == []
    assert find_foreign_secrets("sure: AB23CD45 and XY67ZW89", "AB23CD45", pool) == ["XY67ZW89"]
    # split by spaces, dashes or newlines still counts
    assert find_foreign_secrets("XY67 ZW-89\n PQ23\nRS45", None, pool) == ["XY67ZW89", "PQ23RS45"]
    assert find_foreign_secrets("nothing here, just prose about rivers", "AB23CD45", pool) == []
    assert contains_secret(" AB2 3CD45\n", "AB23CD45") and not contains_secret("AB23CD4", "AB23CD45")


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200), st.text(max_size=200), st.integers(0, 2**31))
def test_a_foreign_secret_is_found_anywhere(before: str, after: str, seed: int) -> None:
    own, other = make_secrets(2, random.Random(seed))
    found = find_foreign_secrets(before + other + after, own, frozenset({own, other}))
    assert other in found and own not in found


def test_error_body_checks() -> None:
    good = {"error": {"message": "too long", "type": "invalid_request_error", "param": None,
                      "code": "context_length_exceeded"}}
    assert error_problem(good) is None
    assert error_problem({"error": {"message": "x", "type": "server_error"}}) is None
    assert error_problem("Internal Server Error") is not None
    assert error_problem({"detail": "Not Found"}) is not None  # FastAPI's default shape
    assert error_problem({"object": "error", "message": "x", "type": "BadRequestError"}) is not None  # unwrapped
    assert error_problem({"error": "boom"}) is not None
    assert error_problem({"error": {"message": "", "type": "x"}}) is not None
    assert error_problem({"error": {"message": "x", "type": 400}}) is not None
    assert error_problem({"error": {"message": "x"}}) is not None


def test_plan_mixes_kinds_spreads_over_window_and_pairs_consistency() -> None:
    solo, load = build_plan(100, 10, 6, window=2048, max_tokens=24, stream=True, rng=random.Random(3))
    assert len(solo) == 6 and all(s.phase == "solo" and s.consistency is not None for s in solo)
    assert len(load) == 100 + 10 + 6
    assert [s.index for s in solo + load] == list(range(len(solo) + len(load)))
    assert {(s.endpoint, s.stream) for s in load} == {("chat", False), ("chat", True), ("completion", False),
                                                     ("completion", True)}
    over = [i for i, s in enumerate(load) if s.over_window]
    assert len(over) == 10 and min(over) >= len(load) // 4  # after many pages have been used
    assert all(s.target_tokens > 2048 for s in load if s.over_window)
    in_window = [s.target_tokens for s in load if s.secret and not s.over_window]
    usable = Sizing(2048, 24, 1, 1).usable
    assert max(in_window) <= usable and max(in_window) >= 0.75 * usable and min(in_window) <= 64
    secrets = [s.secret for s in load if s.secret]
    assert len(set(secrets)) == len(secrets) == 110
    _, no_stream = build_plan(20, 2, 0, 2048, 24, stream=False, rng=random.Random(3))
    assert not any(s.stream for s in no_stream)


def test_sizing_keeps_in_window_small_and_over_window_large() -> None:
    s = sizing_from_calibration(1000, 16, 4.0)
    assert s.fit_cpt < 4.0 < s.over_cpt
    blind = sizing_from_calibration(1000, 16, None)
    assert blind.fit_cpt <= 2.0 and blind.over_cpt >= 8.0


def _res(index: int, secret: str | None, status: int | None, text: str = "", *, over: bool = False,
         stream: bool = False, problems: list[str] | None = None, consistency: int | None = None,
         phase: str = "load") -> Result:
    spec = RequestSpec(index, "completion", stream, secret, 100, over, consistency, phase)  # type: ignore[arg-type]
    return Result(spec, "ok" if status == 200 else "http_error", status=status, latency_s=0.1, text=text,
                  problems=problems or [])


def test_violations_and_verdict() -> None:
    secrets = {"AB23CD45": 0, "XY67ZW89": 1, "PQ23RS45": 2}
    clean = [_res(0, "AB23CD45", 200, "AB23CD45"), _res(1, "XY67ZW89", 200, "XY67ZW89"),
             _res(2, "PQ23RS45", 400, over=True), _res(3, None, 200, "1, 2", consistency=0, phase="solo"),
             _res(4, None, 200, "1, 3", consistency=0)]
    violations, cons = find_violations(clean, secrets, strict=False)
    assert violations == [] and cons["compared"] == 1 and cons["rate"] == 1.0
    strict, _ = find_violations(clean, secrets, strict=True)
    assert [v["kind"] for v in strict] == ["inconsistent_under_load"]
    report = build_report(clean, secrets, False, {}, planned=5, min_completed=0.5)
    assert report["exit_code"] == 0 and report["canary_echo"]["rate"] == 1.0

    bad = [_res(0, "AB23CD45", 200, "AB23CD45"),
           _res(2, "PQ23RS45", 200, "here: AB23CD45", over=True),
           _res(1, "XY67ZW89", 500, over=True, problems=["HTTP 500 body is not JSON"]),
           _res(5, "ZZ22ZZ33", 200, "ZZ", stream=True,
                problems=["stream ended without [DONE] and without an error event"])]
    kinds = sorted(v["kind"] for v in find_violations(bad, secrets, False)[0])
    assert kinds == ["5xx_for_over_window", "bad_error_format", "broken_stream", "leak", "over_window_200"]
    leak = next(v for v in find_violations(bad, secrets, False)[0] if v["kind"] == "leak")
    assert leak["evidence"]["owner"] == 0 and leak["request"] == 2
    report = build_report(bad, secrets, False, {}, planned=4, min_completed=0.5)
    assert report["exit_code"] == 1 and report["leaks"] == 1

    few = [_res(0, "AB23CD45", 200, "AB23CD45")] + [Result(_res(i, None, None).spec, "cancelled")
                                                    for i in range(1, 5)]
    assert build_report(few, secrets, False, {}, planned=5, min_completed=0.5)["exit_code"] == 2


def test_quantile() -> None:
    assert quantile([], 0.5) is None
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([float(i) for i in range(1, 101)], 0.99) == 99.0


def test_a_stream_that_timed_out_after_its_200_is_not_an_answered_canary() -> None:
    secrets = {"AB23CD45": 0, "XY67ZW89": 1}
    done = _res(0, "AB23CD45", 200, "AB23CD45", stream=True)
    late = _res(1, "XY67ZW89", 200, "", stream=True)
    late.outcome = "timeout"
    report = build_report([done, late], secrets, False, {}, planned=2, min_completed=0.5)
    echo = {k: v for k, v in report["canary_echo"].items() if k != "by_length"}
    assert echo == {"answered": 1, "echoed_own_secret": 1, "rate": 1.0}
    assert report["by_kind"]["completion+stream"]["statuses"] == {"200": 1, "timeout": 1}
    assert report["violations"] == [] and report["exit_code"] == 0


def test_long_prompts_ignored_is_a_violation() -> None:
    from kvseal.audit.canary import RequestSpec
    from kvseal.audit.report import echo_by_length
    from kvseal.audit.runner import Result

    def res(i: int, tokens: int, echoed: bool) -> Result:
        secret = f"SECRET{i:02d}"
        spec = RequestSpec(i, "completion", False, secret, tokens)
        return Result(spec, "ok", 200, text=f" {secret}" if echoed else " ------------")

    healthy = [res(i, 100, True) for i in range(8)] + [res(10 + i, 900, True) for i in range(6)]
    assert echo_by_length(healthy)[1] == []
    placeholder = [res(i, 100, True) for i in range(8)] + [res(10 + i, 900, False) for i in range(6)]
    summary, violations = echo_by_length(placeholder)
    assert [v["kind"] for v in violations] == ["long_prompts_ignored"]
    assert summary["long"]["rate"] == 0.0 and summary["short"]["rate"] == 1.0

"""The benchmark module imports, and its pure helpers compute what they say on fixed inputs (no timing)."""

from __future__ import annotations

import math

import pytest

from benchmarks import common
from benchmarks import engine_vs_hf as bench


def test_percentile_and_median() -> None:
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert common.median(xs) == 3.0
    assert common.median([1.0, 2.0, 3.0, 4.0]) == 2.5
    assert common.percentile(xs, 0) == 1.0
    assert common.percentile(xs, 100) == 5.0
    assert common.percentile(xs, 25) == 2.0
    assert common.percentile(list(range(1, 101)), 99) == pytest.approx(99.01)  # numpy's "linear"
    assert common.percentile([7.0], 99) == 7.0
    assert math.isnan(common.percentile([], 50))


def test_request_latency() -> None:
    # sent at 10.0; first token at 10.5; then 3 more tokens by 10.8 -> TPOT 0.1
    arrivals = [(10.5, 1), (10.6, 1), (10.8, 2)]
    ttft, tpot = common.request_latency(10.0, arrivals)
    assert ttft == pytest.approx(0.5)
    assert tpot == pytest.approx(0.1)
    ttft, tpot = common.request_latency(10.0, arrivals, num_tokens=7)  # the usage count wins over chunks
    assert tpot == pytest.approx(0.05)
    assert math.isnan(common.request_latency(0.0, [(1.0, 1)])[1])  # one token: no TPOT
    assert all(math.isnan(x) for x in common.request_latency(0.0, []))


def test_run_stats_and_median_of_runs() -> None:
    reqs = [(0.0, [(1.0, 1), (2.0, 9)], 10), (0.0, [(2.0, 1), (4.0, 9)], 10)]
    s = common.run_stats(reqs)
    assert s["tok_s"] == pytest.approx(20 / 4.0)
    assert s["tokens"] == 20
    assert s["ttft_median"] == pytest.approx(1.5)
    assert s["tpot_median"] == pytest.approx((1 / 9 + 2 / 9) / 2)
    assert s["ttft_p99"] == pytest.approx(1.0 + 0.99)
    m = common.median_of_runs([{"a": 1.0, "b": math.nan}, {"a": 3.0, "b": 2.0}, {"a": 2.0, "b": math.nan}])
    assert m["a"] == 2.0 and m["b"] == 2.0


def test_formatting() -> None:
    assert common.fmt_num(1234.567) == "1,234.6"
    assert common.fmt_num(math.nan) == "—"
    assert common.fmt_ms(0.0123) == "12.3"
    assert common.fmt_ms(1.5) == "1,500"
    assert common.fmt_ratio(300.0, 100.0) == "300.0 (3.00×)"
    assert common.fmt_ratio(300.0, None) == "300.0"
    table = common.markdown_table(["a", "bb"], [["1", "2"], ["333", "4"]])
    assert table.splitlines() == ["| a   | bb |", "|-----|----|", "| 1   | 2  |", "| 333 | 4  |"]


def test_workload_helpers() -> None:
    prompts = common.make_prompts(3, 16, vocab_size=1000, seed=0)
    assert len(prompts) == 3 and all(len(p) == 16 for p in prompts)
    assert all(256 <= t < 1000 for p in prompts for t in p)
    assert prompts == common.make_prompts(3, 16, vocab_size=1000, seed=0)  # deterministic
    ids, mask = common.left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids == [[5, 6, 7], [0, 0, 8]]
    assert mask == [[1, 1, 1], [0, 0, 1]]


def test_args_and_tables() -> None:
    a = bench.parse_args(["--quick", "--dtypes", "float32"])
    assert a.concs == [1, 4] and a.repeats == 1 and a.dtype_list == ["float32"]
    run = {"tok_s": 10.0, "tokens": 16.0, "wall_s": 1.6, "ttft_median": 0.2, "ttft_p99": 0.3,
           "tpot_median": 0.05, "tpot_p99": 0.06}
    system = {"summary": {"1": run, "4": {**run, "tok_s": 30.0}}, "prefill": {"ttft": 0.5, "tok_s": 512.0}}
    hf = {"summary": {"1": {**run, "tok_s": 5.0}, "4": {**run, "tok_s": 10.0}},
          "prefill": {"ttft": 1.0, "tok_s": 256.0}}
    out = {"results": {"float32": {"hf": hf, "engine": system, "greedy_match": 16}}}
    text = bench.tables(out, [1, 4], 256)
    assert "| float32 | decode tok/s, c=4" in text
    assert "30.0 (3.00×)" in text and "512.0 (2.00×)" in text
    assert "first 16 greedy tokens are identical" in text


def test_prefill_profile_timers_count_macs_and_put_the_ops_back() -> None:
    import types

    import torch

    from benchmarks import prefill_profile as pp

    mod = types.SimpleNamespace(linear=lambda x, w: x @ w.T)
    original = mod.linear
    t = pp.Timers()
    t.wrap(mod, "linear", "matrix products", pp.linear_macs)
    mod.linear(torch.ones(3, 4), torch.ones(5, 4))
    mod.linear(torch.ones(2, 4), torch.ones(5, 4))
    assert t.macs["matrix products"] == 3 * 4 * 5 + 2 * 4 * 5 and t.s["matrix products"] > 0
    t.undo()
    assert mod.linear is original

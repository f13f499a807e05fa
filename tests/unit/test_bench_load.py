"""`kvseal bench`'s pure parts on fixed inputs: datasets, the arrival schedule, metrics, flags (no timing)."""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
from pathlib import Path

import pytest

from kvseal.bench.load import dataset
from kvseal.bench.load.client import chunk_output, request_body
from kvseal.bench.load.config import (
    BenchConfig,
    Level,
    add_bench_args,
    config_from_args,
    parse_goodput,
    parse_rate,
    sweep_levels,
)
from kvseal.bench.load.metrics import RequestResult, error_counts, meets, summarize
from kvseal.bench.load.report import json_safe, render_table
from kvseal.bench.load.schedule import arrival_offsets


def cfg_of(*argv: str) -> BenchConfig:
    p = argparse.ArgumentParser()
    add_bench_args(p)
    return config_from_args(p.parse_args(list(argv)), "http://127.0.0.1:1")


# -- datasets --------------------------------------------------------------------------------------------


def test_lengths_stay_in_the_range_and_cover_it() -> None:
    xs = dataset.lengths(2000, 100, 0.5, random.Random(1))
    assert min(xs) == 50 and max(xs) == 150  # both ends reachable, nothing outside
    assert 95 < statistics.mean(xs) < 105
    assert dataset.lengths(50, 100, 0.0, random.Random(1)) == [100] * 50
    assert min(dataset.lengths(500, 3, 0.9, random.Random(2))) == 1  # never below one token


def test_fixed_prompts_are_exact_token_ids_and_seeded() -> None:
    cfg = cfg_of("--dataset", "fixed", "--input-len", "64", "--output-len", "7", "--seed", "3")
    ps = dataset.build(cfg, 20)
    assert len(ps) == 20
    for p in ps:
        assert isinstance(p.prompt, list) and len(p.prompt) == 64 and p.input_len == 64 and p.output_len == 7
        assert all(1000 <= t < 20000 for t in p.prompt)
    assert dataset.build(cfg, 20) == ps  # same seed, same prompts
    assert dataset.build(cfg_of("--input-len", "64", "--output-len", "7", "--seed", "4"), 20) != ps
    assert dataset.build(cfg, 5) == ps[:5]  # a smaller pass takes the front of the same list


def test_fresh_prompts_never_resend_one() -> None:
    warm, passes = dataset.slices([1, 8, 3], warmup=2, fresh=False)
    assert warm == [0, 1] and passes == [range(1), range(8), range(3)]  # every pass from the front
    warm, passes = dataset.slices([1, 8, 3], warmup=2, fresh=True)
    assert passes == [range(1), range(1, 9), range(9, 12)] and warm == [12, 13]
    sent = [i for r in passes for i in r] + warm
    assert len(sent) == len(set(sent)) == 14  # no prompt twice, so no prefix-cache hit between passes
    assert cfg_of("--fresh-prompts").fresh_prompts and not cfg_of().fresh_prompts
    cfg = cfg_of("--input-len", "16", "--fresh-prompts")
    ps = dataset.build(cfg, 14)
    assert len({tuple(p.prompt) for p in ps}) == 14  # distinct token ids, not only distinct indices
    assert dataset.build(cfg, 3) == ps[:3]


def test_prefix_prompts_share_their_heads_in_turn() -> None:
    cfg = cfg_of("--dataset", "prefix", "--prefix-len", "40", "--suffix-len", "9", "--num-prefixes", "3",
                 "--output-len", "5")
    ps = dataset.build(cfg, 7)
    assert all(isinstance(p.prompt, list) and len(p.prompt) == 49 and p.input_len == 49 for p in ps)
    heads = [tuple(p.prompt[:40]) for p in ps]  # type: ignore[index]
    assert len(set(heads)) == 3 and heads[0] == heads[3] == heads[6] and heads[1] == heads[4]
    assert len({tuple(p.prompt[40:]) for p in ps}) == 7  # type: ignore[index]
    assert dataset.build(cfg, 3) == ps[:3]
    chat = dataset.build(cfg_of("--dataset", "prefix", "--prefix-len", "30", "--suffix-len", "5",
                                "--num-prefixes", "2", "--endpoint", "chat"), 4)
    assert all(isinstance(p.prompt, str) and len(p.prompt.split()) == 35 for p in chat)
    assert chat[0].prompt.split()[:30] == chat[2].prompt.split()[:30]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="--num-prefixes"):
        cfg_of("--dataset", "prefix", "--num-prefixes", "0")


def test_random_prompts_follow_the_range_ratio() -> None:
    cfg = cfg_of("--dataset", "random", "--input-len", "40", "--output-len", "20", "--range-ratio", "0.5")
    ps = dataset.build(cfg, 300)
    ins = [p.input_len for p in ps]
    outs = [p.output_len for p in ps]
    assert all(isinstance(p.prompt, list) and len(p.prompt) == p.input_len for p in ps)
    assert min(ins) >= 20 and max(ins) <= 60 and len(set(ins)) > 10
    assert min(outs) >= 10 and max(outs) <= 30 and len(set(outs)) > 5
    assert dataset.build(cfg, 300) == ps


def test_chat_prompts_are_words() -> None:
    ps = dataset.build(cfg_of("--endpoint", "chat", "--input-len", "33", "--output-len", "4"), 3)
    for p in ps:
        assert isinstance(p.prompt, str) and len(p.prompt.split()) == 33 and p.input_len == 33
        assert set(p.prompt.split()) <= set(dataset.WORDS)


def test_tokenizer_sets_the_id_range_and_counts(tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(399)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    ps = dataset.build(cfg_of("--tokenizer", str(tmp_path), "--input-len", "16", "--output-len", "2"), 10)
    assert all(isinstance(p.prompt, list) and all(100 <= t < 400 for t in p.prompt) for p in ps)
    chat = dataset.build(cfg_of("--tokenizer", str(tmp_path / "tokenizer.json"), "--endpoint", "chat",
                                "--input-len", "12", "--output-len", "2"), 3)
    assert all(isinstance(p.prompt, str) and p.input_len == 12 for p in chat)


def test_jsonl_rows_defaults_reuse_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a b", "output_len": 3}\n\n{"prompt": "c"}\n')
    ps = dataset.build(cfg_of("--dataset", "jsonl", "--dataset-path", str(f), "--output-len", "9"), 5)
    assert [(p.prompt, p.output_len, p.input_len) for p in ps] == [
        ("a b", 3, None), ("c", 9, None), ("a b", 3, None), ("c", 9, None), ("a b", 3, None)]
    for bad, where in (('{"prompt": 1}', "line 1"), ('{"prompt": "x"}\n{"prompt": "y", "output_len": 0}', "line 2"),
                       ("not json", "line 1"), ("", "no prompts")):
        with pytest.raises(ValueError, match=where):
            dataset.parse_jsonl(bad.splitlines(), 4)
    with pytest.raises(ValueError, match="--dataset-path"):
        cfg_of("--dataset", "jsonl")


# -- arrivals --------------------------------------------------------------------------------------------


def test_poisson_schedule() -> None:
    offs = arrival_offsets(20000, 4.0, random.Random(0))
    assert offs[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(offs))
    gaps = [b - a for a, b in itertools.pairwise(offs)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: sd equals the mean
    assert arrival_offsets(5, 4.0, random.Random(0)) == offs[:5]
    assert arrival_offsets(4, math.inf, random.Random(0)) == [0.0] * 4


# -- metrics on hand-computed values ----------------------------------------------------------------------


def results() -> list[RequestResult]:
    return [
        # 4 chunks of one token each, no usage: TTFT .5, TPOT (1.0-.5)/3, ITL .1 .2 .2, E2E 1.1
        RequestResult(0, 10, 4, t_send=0.0, t_end=1.1, arrivals=[0.5, 0.6, 0.8, 1.0]),
        # 2 chunks but usage says 5 tokens: TTFT .2, TPOT .1/4, ITL .1, E2E .4, 12 prompt tokens by usage
        RequestResult(1, 10, 5, t_send=1.0, t_end=1.4, arrivals=[1.2, 1.3], usage_prompt=12, usage_completion=5),
        RequestResult(2, 10, 4, t_send=0.5, t_end=0.6, error="HTTP 400: bad"),
        # asked 8, got 1: completed but short; no TPOT, TTFT .9, E2E 1.0
        RequestResult(3, 10, 8, t_send=0.0, t_end=1.0, arrivals=[0.9], usage_completion=1),
    ]


def test_per_request_numbers() -> None:
    r0, r1, _, r3 = results()
    assert r0.ttft_tpot() == pytest.approx((0.5, 0.5 / 3))
    assert r0.itl() == pytest.approx([0.1, 0.2, 0.2]) and r0.e2e() == pytest.approx(1.1)
    assert r0.output_tokens == 4 and r0.input_tokens == 10 and not r0.short
    assert r1.ttft_tpot() == pytest.approx((0.2, 0.025)) and r1.output_tokens == 5 and r1.input_tokens == 12
    assert math.isnan(r3.ttft_tpot()[1]) and r3.short


def test_summary_on_hand_computed_values() -> None:
    s = summarize(results(), 2.0, parse_goodput(["ttft:600", "tpot:100"]))
    assert (s["num_requests"], s["completed"], s["failed"], s["short_outputs"]) == (4, 3, 1, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (32, 10)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert (s["input_tok_s"], s["output_tok_s"], s["total_tok_s"]) == pytest.approx((16.0, 5.0, 21.0))
    expect = {"ttft": (1600 / 3, 500.0, 892.0),
              "tpot": ((500 / 3 + 25) / 2, (500 / 3 + 25) / 2, 25 + (500 / 3 - 25) * 0.99),
              "itl": (150.0, 150.0, 200.0), "e2e": (2500 / 3, 1000.0, 1098.0)}
    for m, (mean, med, p99) in expect.items():
        assert (s[f"{m}_mean_ms"], s[f"{m}_median_ms"], s[f"{m}_p99_ms"]) == pytest.approx((mean, med, p99)), m
    # only request 1 meets TTFT <= 600 ms and TPOT <= 100 ms (0 is too slow per token, 3 too slow to start)
    assert s["good_requests"] == 1 and s["goodput"] == pytest.approx(0.5)
    assert summarize(results(), 2.0)["goodput"] is None
    assert error_counts(results()) == {"HTTP 400: bad": 1}


def test_goodput_limits() -> None:
    r0, r1, r2, r3 = results()
    tpot = parse_goodput(["tpot:100"])
    assert [meets(r, tpot) for r in (r0, r1, r2, r3)] == [False, True, False, True]  # one token: no TPOT
    assert [meets(r, parse_goodput(["e2e:1050"])) for r in (r0, r1, r2, r3)] == [False, True, False, True]
    assert not meets(RequestResult(0, 1, 1, t_send=0.0, t_end=1.0), parse_goodput(["ttft:5000"]))  # no output
    assert parse_goodput(["ttft:500", "E2EL:2000"]) == (("ttft", 0.5), ("e2e", 2.0))
    for bad in ("ttft", "foo:1", "ttft:x", "tpot:0"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput([bad])


def test_all_failed_pass_has_no_latencies() -> None:
    s = summarize([RequestResult(0, 5, 5, error="timeout")], 1.0)
    assert s["completed"] == 0 and s["failed"] == 1 and math.isnan(s["ttft_median_ms"])
    assert json_safe({"a": [s["ttft_p99_ms"], math.inf, 1.5]}) == {"a": [None, "inf", 1.5]}


# -- flags, sweeps and the request body -------------------------------------------------------------------


def test_sweep_parsing() -> None:
    assert sweep_levels("inf", "1,4,16,32", 10, None) == tuple(Level(math.inf, c, 10) for c in (1, 4, 16, 32))
    assert sweep_levels("2, 8", None, 5, None) == (Level(2.0, None, 5), Level(8.0, None, 5))
    assert [lv.num_prompts for lv in sweep_levels("inf", "1,4", 10, "3,12")] == [3, 12]
    assert [lv.num_prompts for lv in sweep_levels("inf", "1,4", 10, "7")] == [7, 7]
    assert sweep_levels("5", "8", 3, None) == (Level(5.0, 8, 3),)
    assert parse_rate("INF") == math.inf and parse_rate("0.5") == 0.5
    for rates, concs, per, match in (("1,2", "1,2", None, "not both"), ("inf", "0,4", None, "at least 1"),
                                     ("inf", "1,,4", None, "comma"), ("0", None, None, "positive"),
                                     ("inf", "1,4,8", "1,2", "3 passes"), ("inf", "x", None, "whole numbers")):
        with pytest.raises(ValueError, match=match):
            sweep_levels(rates, concs, 10, per)


def test_config_and_sweep_key() -> None:
    cfg = cfg_of("--max-concurrency", "1,4", "--num-prompts", "8", "--goodput", "ttft:500", "tpot:100")
    assert cfg.sweep_key == "max_concurrency" and cfg.goodput == (("ttft", 0.5), ("tpot", 0.1))
    assert cfg.endpoint == "completions" and cfg.dataset == "fixed" and cfg.levels[1] == Level(math.inf, 4, 8)
    assert cfg_of("--request-rate", "1,2", "--max-concurrency", "4").sweep_key == "request_rate"
    assert cfg_of().sweep_key == "request_rate"
    for argv, match in ((["--range-ratio", "1"], "range-ratio"), (["--output-len", "0"], "output-len"),
                        (["--warmup", "-1"], "warmup"), (["--plot", "/nonexistent/dir/p.png"], "--plot")):
        with pytest.raises(ValueError, match=match):
            cfg_of(*argv)


def test_request_bodies_ask_for_exactly_output_len_tokens() -> None:
    path, body = request_body("completions", "m", dataset.Prompt([5, 6, 7], 3, 9))
    assert path == "/v1/completions" and body["prompt"] == [5, 6, 7]
    assert (body["max_tokens"], body["min_tokens"], body["ignore_eos"], body["temperature"]) == (9, 9, True, 0.0)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True} and body["model"] == "m"
    path, body = request_body("chat", "m", dataset.Prompt("hi there", 2, 4))
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "hi there"}]
    assert body["max_tokens"] == body["max_completion_tokens"] == body["min_tokens"] == 4


def test_chunk_output() -> None:
    assert chunk_output({"choices": [{"text": "ab"}]}, chat=False) == "ab"
    assert chunk_output({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, chat=True) == ""
    assert chunk_output({"choices": [{"delta": {"reasoning_content": "x", "content": None}}]}, chat=True) == "x"
    assert chunk_output({"choices": [], "usage": {"completion_tokens": 3}}, chat=False) == ""


def test_table_has_a_column_per_pass() -> None:
    s = summarize(results(), 2.0, parse_goodput(["ttft:600"]))
    passes = [{"level": {"request_rate": math.inf, "max_concurrency": c, "num_prompts": 4}, "metrics": s}
              for c in (1, 4)]
    lines = render_table(passes, "max_concurrency", True).splitlines()
    assert [c.strip() for c in lines[0].split("|")[2:4]] == ["c=1", "c=4"]
    row = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in lines[2:]}
    assert row["completed / failed"] == ["3 / 1", "3 / 1"] and row["output tok/s"] == ["5.0", "5.0"]
    assert row["TTFT median (ms)"] == ["500.0", "500.0"] and row["goodput (req/s)"] == ["1.00", "1.00"]


def test_cached_prompt_tokens_are_summed_when_the_server_reports_them() -> None:
    def done(cached: int | None) -> RequestResult:
        return RequestResult(0, 10, 2, t_send=0.0, t_end=1.0, arrivals=[0.5, 1.0], usage_prompt=10,
                             usage_completion=2, usage_cached=cached)

    assert summarize([done(8), done(0)], 1.0)["cached_input_tokens"] == 8
    assert summarize([done(None)], 1.0)["cached_input_tokens"] is None  # a server without the field: unknown

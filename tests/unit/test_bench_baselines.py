"""The baseline benchmark's pure parts: server and load commands, the combined table, hf_server's request
parsing and its batched decode loop (on a tiny random model, against transformers' generate)."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import torch

from kvseal.bench import baselines as bl
from kvseal.bench import hf_server as hs

S = bl.Settings(model_path="/m/SmolLM2.gguf", threads=None)


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_server_commands() -> None:
    uni = bl.server_command("kvseal", 1234, S, python="py")
    assert uni[:4] == ["py", "-m", "kvseal", "serve"] and "--unified" in uni and "--prefill" not in uni
    assert _flag(uni, "--port") == "1234" and _flag(uni, "--host") == "127.0.0.1"
    assert _flag(uni, "--dtype") == "float32" and "--threads" not in uni
    assert "/m/SmolLM2.gguf" not in uni  # the bundled default, unless a model was given

    dis = bl.server_command("kvseal-disagg", 1, bl.Settings(model_path="/x.gguf", threads=2, explicit_model=True))
    assert "--unified" not in dis and _flag(dis, "--prefill") == "1" and _flag(dis, "--decode") == "1"
    assert _flag(dis, "--threads") == "2" and dis[4] == "/x.gguf"

    ll = bl.server_command("llama.cpp", 99, S)
    assert ll[1:3] == ["-m", "kvseal.bench.llamacpp_server"]
    assert _flag(ll, "--model") == "/m/SmolLM2.gguf" and _flag(ll, "--n_ctx") == "8192"
    assert _flag(ll, "--interrupt_requests") == "false" and _flag(ll, "--logits_all") == "false"
    assert int(_flag(ll, "--n_threads")) >= 1 and _flag(ll, "--port") == "99"

    hf = bl.server_command("hf", 7, bl.Settings(model_path="/m.gguf", dtype="bfloat16", max_batch=8))
    assert hf[1:3] == ["-m", "kvseal.bench.hf_server"]
    a = hs.parse_args(hf[3:])  # hf_server's own parser accepts exactly what baselines passes
    assert (a.port, a.dtype, a.max_batch, a.max_model_len, a.model) == (7, "bfloat16", 8, 8192, None)

    with pytest.raises(ValueError, match="unknown system"):
        bl.server_command("vllm", 1, S)


def test_bench_command_and_passthrough() -> None:
    cmd = bl.bench_command("http://127.0.0.1:5", "/o/hf.json", input_len=128, output_len=64, num_prompts=10,
                           concurrency="1,4", plot="/o/hf.png", extra=["--warmup", "2"], python="py")
    assert cmd[:4] == ["py", "-m", "kvseal", "bench"]
    assert _flag(cmd, "--base-url") == "http://127.0.0.1:5" and _flag(cmd, "--dataset") == "fixed"
    assert (_flag(cmd, "--input-len"), _flag(cmd, "--output-len"), _flag(cmd, "--num-prompts")) == ("128", "64", "10")
    assert _flag(cmd, "--max-concurrency") == "1,4" and _flag(cmd, "--result-json") == "/o/hf.json"
    assert _flag(cmd, "--plot") == "/o/hf.png" and cmd[-2:] == ["--warmup", "2"]
    assert "--plot" not in bl.bench_command("u", "r", input_len=1, output_len=1, num_prompts=1, concurrency="1",
                                            plot=None)

    a, extra = bl.parse_args(["--systems", "hf,kvseal", "--num-prompts", "8", "--", "--warmup", "0"])
    assert a.system_list == ["hf", "kvseal"] and a.num_prompts == 8 and extra == ["--warmup", "0"]
    with pytest.raises(SystemExit):
        bl.parse_args(["--systems", "hf,tgi"])


def _result(levels: list[tuple[int, float, float | None, float | None]], failed: int = 0,
            short: int = 0) -> dict[str, Any]:
    return {"sweep_key": "max_concurrency", "passes": [
        {"level": {"max_concurrency": c, "request_rate": "inf"},
         "metrics": {"output_tok_s": tok, "ttft_median_ms": ttft, "tpot_median_ms": tpot, "completed": 10,
                     "failed": failed, "short_outputs": short}} for c, tok, ttft, tpot in levels]}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_build_table() -> None:
    results: dict[str, dict[str, Any] | None] = {
        "kvseal": _result([(1, 100.0, 20.5, 9.87), (4, 350.25, 30.0, 11.0)]),
        "llama.cpp": _result([(1, 250.0, 5.0, 4.0), (4, 260.0, 400.0, None)], short=3),
        "hf": None,
    }
    table = bl.build_table(results)
    lines = table.splitlines()
    assert _cells(lines[0]) == ["load", "system", "output tok/s", "median TTFT (ms)", "median TPOT (ms)"]
    assert [_cells(ln) for ln in lines[2:6]] == [
        ["c=1", "kvseal unified", "100.0", "20.5", "9.9"],
        ["c=1", "llama-cpp-python", "250.0", "5.0", "4.0"],
        ["c=4", "kvseal unified", "350.2", "30.0", "11.0"],
        ["c=4", "llama-cpp-python", "260.0", "400.0", "—"],
    ]
    assert lines[6] == ""
    assert "- transformers: did not run" in table
    assert "- llama-cpp-python c=1: 0 failed, 3 short outputs" in table
    assert "llama-cpp-python c=4: 0 failed, 3 short outputs" in table


def test_table_levels_union_and_rate_labels() -> None:
    a = {"passes": [{"level": {"max_concurrency": None, "request_rate": "inf"}, "metrics": {"output_tok_s": 1}},
                    {"level": {"max_concurrency": None, "request_rate": 2.5}, "metrics": {"output_tok_s": 2}}]}
    assert list(bl.passes_by_level(a)) == ["rate=inf", "rate=2.5/s"]
    t = bl.build_table({"kvseal": _result([(1, 1.0, 1.0, 1.0)]), "hf": _result([(2, 2.0, 2.0, 2.0)])})
    assert [_cells(ln)[:2] for ln in t.splitlines()[2:]] == [["c=1", "kvseal unified"], ["c=2", "transformers"]]


# -- hf_server -------------------------------------------------------------------------------------------


def _parse(body: Any) -> dict[str, Any]:
    return hs.parse_completion(body, lambda s: [ord(c) for c in s], vocab_size=300, max_context=64)


def test_parse_completion() -> None:
    r = _parse({"prompt": "hi", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "min_tokens": 5,
                "stream": True, "stream_options": {"include_usage": True}, "seed": 3, "model": "anything"})
    assert r == {"prompt": [104, 105], "max_tokens": 5, "min_tokens": 5, "temperature": 0.0, "top_p": 1.0,
                 "ignore_eos": True, "seed": 3, "stream": True, "include_usage": True}
    assert _parse({"prompt": [1, 2, 3]})["prompt"] == [1, 2, 3]
    assert _parse({"prompt": [1]})["max_tokens"] == 16  # OpenAI's default
    bad = [{"prompt": []}, {"prompt": ""}, {"prompt": [1, 300]}, {"prompt": [True]}, {"prompt": ["a", "b"]},
           {"prompt": "x", "n": 2}, {"prompt": "x", "logprobs": 1}, {"prompt": "x", "stop": ["\n"]},
           {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "max_tokens": 64},
           {"prompt": "x", "temperature": "hot"}, {"prompt": "x", "max_tokens": 1.5}, [1, 2]]
    for body in bad:
        with pytest.raises(hs.BadRequest):
            _parse(body)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoModelForCausalLM

    from tests.helpers.tiny_models import make_tiny_llama

    folder = make_tiny_llama(tmp_path_factory.mktemp("tiny"), "llama", tie=False)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _generate(model: Any, prompt: list[int], n: int, eos: int | None) -> list[int]:
    kw: dict[str, Any] = {"min_new_tokens": n} if eos is None else {"eos_token_id": eos}
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, pad_token_id=2, **kw)
    return [int(t) for t in out[0, len(prompt):]]


def _run(model: Any, jobs_spec: list[dict[str, Any]], eos: int = 2) -> tuple[list[hs.Job], list[list[Any]]]:
    events: list[list[Any]] = [[] for _ in jobs_spec]
    jobs = [hs.Job(emit=events[i].append, **spec) for i, spec in enumerate(jobs_spec)]
    hs.BatchDecoder(model, [eos], eos).run(jobs)
    return jobs, events


def test_batch_decoder_greedy_equals_generate(tiny_hf: Any) -> None:
    """Left-padded prompts of different lengths and max_tokens in one batch (rows leave as they finish):
    each row's greedy tokens are exactly what generate gives for that prompt alone."""
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28], [40]]
    lens = [10, 4, 12, 7]
    _, events = _run(tiny_hf, [{"prompt": p, "max_tokens": n, "ignore_eos": True} for p, n in zip(prompts, lens)])
    for p, n, ev in zip(prompts, lens, events):
        assert ev[-1] == ("end", "length")
        assert [v for k, v in ev[:-1]] == _generate(tiny_hf, p, n, None)
        assert all(k == "token" for k, _ in ev[:-1])


def test_batch_decoder_eos_and_min_tokens(tiny_hf: Any) -> None:
    """Pick as "EOS" the token greedy decoding produces third: without ignore_eos the row stops there
    ("stop"), with min_tokens it cannot, and generate agrees in both cases."""
    p = [5, 6, 7, 8, 9, 10]
    free = _generate(tiny_hf, p, 8, None)
    eos = free[2]
    assert eos not in free[:2]
    _, (ev,) = _run(tiny_hf, [{"prompt": p, "max_tokens": 8}], eos=eos)
    assert ev == [("token", t) for t in free[:3]] + [("end", "stop")]
    _, (ev,) = _run(tiny_hf, [{"prompt": p, "max_tokens": 8, "min_tokens": 5}], eos=eos)
    toks = [v for k, v in ev if k == "token"]
    assert eos not in toks[:5] and len(toks) >= 5 and ev[-1][0] == "end"
    kw = {"min_new_tokens": 5, "eos_token_id": eos}
    ref = tiny_hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8, pad_token_id=2, **kw)[0, len(p):]
    assert toks == [int(t) for t in ref]


def test_batch_decoder_sampling_is_seeded(tiny_hf: Any) -> None:
    spec = {"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 7, "ignore_eos": True}
    _, (a, b) = _run(tiny_hf, [dict(spec), dict(spec)])
    _, (c,) = _run(tiny_hf, [{**spec, "seed": 8}])
    assert a == b and len(a) == 13 and a != c


def test_batcher_gathers_waiting_requests(tiny_hf: Any) -> None:
    """Requests submitted together run as one batch; a cancelled request is dropped without events."""
    batcher = hs.Batcher(hs.BatchDecoder(tiny_hf, [2], 2), max_batch=3, window_s=0.5)
    done = threading.Semaphore(0)
    events: list[list[Any]] = [[] for _ in range(5)]

    def emit(i: int) -> Any:
        def f(ev: Any) -> None:
            events[i].append(ev)
            if ev[0] == "end":
                done.release()
        return f

    jobs = [hs.Job(prompt=[5 + i], max_tokens=3, ignore_eos=True, emit=emit(i)) for i in range(5)]
    jobs[4].cancelled = True
    for j in jobs:
        batcher.submit(j)
    batcher.start()
    try:
        for _ in range(4):
            assert done.acquire(timeout=60)
    finally:
        batcher.stop()
    assert batcher.batches == 2  # 3 (max_batch) + 1 (the cancelled one never runs)
    assert [len(e) for e in events] == [4, 4, 4, 4, 0]


def test_side_by_side_plot_from_a_finished_run(tmp_path) -> None:
    def result(tok_s: float) -> dict:
        return {"passes": [{"level": {"max_concurrency": c},
                            "metrics": {"output_tok_s": tok_s * c, "ttft_median_ms": 100.0 * c, "tpot_median_ms": 20.0}}
                           for c in (1, 8, 32)]}

    doc = {"systems": {"kvseal": {"result": result(30.0)}, "llama.cpp": {"result": result(10.0)}, "hf": {}}}
    path = tmp_path / "baselines.json"
    path.write_text(json.dumps(doc))
    assert bl.main(["--replot", str(path)]) == 0
    png = (tmp_path / "side_by_side.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

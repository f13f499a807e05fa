"""The baseline benchmark's pure parts: server and load commands, the combined table, hf_server's request
parsing and its batched decode loop (on a tiny random model, against transformers' generate)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import baselines as bl
from benchmarks import baselines_table as bt
from benchmarks import cpu_record
from benchmarks import hf_server as hs
from benchmarks.systems import SYSTEMS, Settings, launch, long_variant, slot_ctx_for, unavailable

S = Settings(model_path="/m/SmolLM2.gguf", threads=None, peers_dir="/peers")


def _flag(cmd: Sequence[str], name: str) -> str:
    return cmd[list(cmd).index(name) + 1]


def test_kvseal_hf_and_llama_cpp_python_commands() -> None:
    uni = launch("kvseal", 1234, S, python="py").argv
    assert uni[:4] == ("py", "-m", "kvseal", "serve") and "--unified" in uni and "--prefill" not in uni
    assert _flag(uni, "--port") == "1234" and _flag(uni, "--host") == "127.0.0.1"
    assert _flag(uni, "--dtype") == "float32" and "--threads" not in uni
    assert "/m/SmolLM2.gguf" not in uni  # the bundled default, unless a model was given
    assert launch("kvseal", 1234, S, "long", python="py").argv == uni  # one server for both workloads

    dis = launch("kvseal-disagg", 1, Settings(model_path="/x.gguf", threads=2, explicit_model=True)).argv
    assert "--unified" not in dis and _flag(dis, "--prefill") == "1" and _flag(dis, "--decode") == "1"
    assert _flag(dis, "--threads") == "2" and dis[4] == "/x.gguf"

    ll = launch("llama-cpp-python", 99, S)
    assert ll.argv[1:3] == ("-m", "benchmarks.llamacpp_server") and ll.ready_path == "/v1/models"
    assert _flag(ll.argv, "--model") == "/m/SmolLM2.gguf" and _flag(ll.argv, "--n_ctx") == "8192"
    assert _flag(ll.argv, "--interrupt_requests") == "false" and _flag(ll.argv, "--logits_all") == "false"
    assert int(_flag(ll.argv, "--n_threads")) >= 1 and _flag(ll.argv, "--port") == "99"

    hf = launch("hf", 7, Settings(model_path="/m.gguf", dtype="bfloat16", max_batch=8))
    a = hs.parse_args(list(hf.argv[3:]))  # hf_server's own parser accepts exactly what baselines passes
    assert (a.port, a.dtype, a.max_batch, a.max_model_len, a.model) == (7, "bfloat16", 8, 8192, None)
    assert hf.argv[1:3] == ("-m", "benchmarks.hf_server") and hf.ready_path == "/health"

    with pytest.raises(ValueError, match="unknown system"):
        launch("tgi", 1, S)
    with pytest.raises(ValueError, match="Settings.slots must be at least 1"):
        Settings(model_path="/m", slots=0)


def test_llama_server_slots_per_workload() -> None:
    """-np 32 -cb --no-cache-prompt with 512 tokens a slot for the load; -np 1 with the whole window for the
    long prompt (a 2,000-token prompt does not fit a 512-token slot)."""
    s = Settings(model_path="/m/q.gguf", threads=2, peers_dir="/peers", slots=32, slot_ctx=512)
    load = launch("llama-server", 8080, s, "load")
    assert load.argv[0] == "/peers/bin/llama-server" and load.ready_path == "/health" and load.env == ()
    assert (_flag(load.argv, "-np"), _flag(load.argv, "-c")) == ("32", "16384")
    assert "-cb" in load.argv and "--no-cache-prompt" in load.argv
    assert (_flag(load.argv, "-m"), _flag(load.argv, "--alias"), _flag(load.argv, "--port")) == (
        "/m/q.gguf", "SmolLM2-135M-Instruct", "8080")
    assert _flag(load.argv, "-t") == _flag(load.argv, "-tb") == "2"
    long = launch("llama-server", 8080, s, "long")
    assert (_flag(long.argv, "-np"), _flag(long.argv, "-c")) == ("1", "8192") and "-cb" in long.argv
    assert long_variant("llama-server", s) == "-np 1 -c 8192"
    assert all(long_variant(x, s) is None for x in SYSTEMS if x != "llama-server")
    assert slot_ctx_for(128, 128) == 512 and slot_ctx_for(1000, 200) == 1280  # room for prompt + output


def test_vllm_command_and_environment() -> None:
    how = launch("vllm", 5, Settings(model_path="/m/q.gguf", peers_dir="/peers", threads=2))
    assert how.argv[:3] == ("/peers/vllm/bin/vllm", "serve", "/peers/models/SmolLM2-135M-Instruct")
    assert _flag(how.argv, "--dtype") == "bfloat16" and _flag(how.argv, "--max-model-len") == "8192"
    assert _flag(how.argv, "--served-model-name") == "SmolLM2-135M-Instruct" and _flag(how.argv, "--port") == "5"
    assert "--no-enable-prefix-caching" not in how.argv  # its default (on), as its users run it
    env = dict(how.env)
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in dict(launch("vllm", 5, S).env)


def test_unavailable_names_what_is_missing(tmp_path: Path) -> None:
    s = Settings(model_path="/m/q.gguf", peers_dir=str(tmp_path))
    assert "not built: no executable" in str(unavailable("llama-server", s))
    assert "setup_baselines.sh llama-server" in str(unavailable("llama-server", s))
    assert "setup_baselines.sh vllm" in str(unavailable("vllm", s))
    assert unavailable("kvseal", s) is None
    for exe in (s.llama_server, s.vllm):
        exe.parent.mkdir(parents=True, exist_ok=True)
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    assert unavailable("llama-server", s) is None
    assert "no converted checkpoint" in str(unavailable("vllm", s))
    s.vllm_model_dir.mkdir(parents=True)
    (s.vllm_model_dir / "config.json").write_text("{}")
    assert unavailable("vllm", s) is None


def test_bench_command_and_passthrough() -> None:
    cmd = bl.bench_command("http://127.0.0.1:5", "/o/hf.json", input_len=128, output_len=64, num_prompts=10,
                           concurrency="1,4", plot="/o/hf.png", extra=["--warmup", "2"], python="py")
    assert cmd[:4] == ["py", "-m", "kvseal", "bench"]
    assert _flag(cmd, "--base-url") == "http://127.0.0.1:5" and _flag(cmd, "--dataset") == "fixed"
    assert (_flag(cmd, "--input-len"), _flag(cmd, "--output-len"), _flag(cmd, "--num-prompts")) == ("128", "64", "10")
    assert _flag(cmd, "--max-concurrency") == "1,4" and _flag(cmd, "--result-json") == "/o/hf.json"
    assert _flag(cmd, "--plot") == "/o/hf.png" and cmd[-2:] == ["--warmup", "2"]
    assert "--fresh-prompts" in cmd  # no prompt twice: vLLM's prefix cache must not answer from an earlier pass
    assert "--plot" not in bl.bench_command("u", "r", input_len=1, output_len=1, num_prompts=1, concurrency="1",
                                            plot=None)

    a, extra = bl.parse_args(["--systems", "hf,kvseal", "--num-prompts", "8", "--", "--warmup", "0"])
    assert a.system_list == ["hf", "kvseal"] and a.num_prompts == 8 and extra == ["--warmup", "0"]
    with pytest.raises(SystemExit):
        bl.parse_args(["--systems", "hf,tgi"])


def test_prompts_per_level_goes_to_the_load_only(tmp_path: Path) -> None:
    a, extra = bl.parse_args(["--max-concurrency", "1,8,32", "--prompts-per-level", "16,32,64",
                              "--long-num-prompts", "3"])
    cmds = bl.workload_commands(a, extra, "http://u", tmp_path, "kvseal", plot=False)
    assert _flag(cmds["load"][1], "--prompts-per-level") == "16,32,64"
    long = cmds["long"][1]
    assert "--prompts-per-level" not in long and _flag(long, "--num-prompts") == "3"


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
        "llama-cpp-python": _result([(1, 250.0, 5.0, 4.0), (4, 260.0, 400.0, None)], short=3),
        "hf": None,
    }
    table = bt.build_table(results)
    lines = table.splitlines()
    assert _cells(lines[0]) == ["load", "system", "output tok/s", "median TTFT (ms)", "median TPOT (ms)"]
    assert [_cells(ln) for ln in lines[2:6]] == [
        ["c=1", "kvseal unified", "100.0", "20.5", "9.9"],
        ["c=1", "llama-cpp-python (1 request at a time)", "250.0", "5.0", "4.0"],
        ["c=4", "kvseal unified", "350.2", "30.0", "11.0"],
        ["c=4", "llama-cpp-python (1 request at a time)", "260.0", "400.0", "—"],
    ]
    assert lines[6] == ""
    assert "- transformers (static batches): did not run" in table
    assert "- llama-cpp-python (1 request at a time) c=1: 0 failed, 3 short outputs" in table
    assert "llama-cpp-python (1 request at a time) c=4: 0 failed, 3 short outputs" in table


def test_table_levels_union_and_rate_labels() -> None:
    a = {"passes": [{"level": {"max_concurrency": None, "request_rate": "inf"}, "metrics": {"output_tok_s": 1}},
                    {"level": {"max_concurrency": None, "request_rate": 2.5}, "metrics": {"output_tok_s": 2}}]}
    assert list(bt.passes_by_level(a)) == ["rate=inf", "rate=2.5/s"]
    t = bt.build_table({"kvseal": _result([(1, 1.0, 1.0, 1.0)]), "hf": _result([(2, 2.0, 2.0, 2.0)])})
    assert [_cells(ln)[:2] for ln in t.splitlines()[2:]] == [["c=1", "kvseal unified"],
                                                             ["c=2", "transformers (static batches)"]]


def test_summary_table_has_a_row_for_every_system() -> None:
    """Measured systems get `tok/s (TTFT / TPOT)` per level and the long prompt's TTFT; one that could not
    start or run gets a row that says why."""
    entries: dict[str, dict[str, Any]] = {
        "kvseal": {"status": "ok", "result": _result([(1, 49.2, 120.0, 18.8), (8, 150.0, 1600.0, 40.0)]),
                   "long_result": _result([(1, 0.25, 4200.0, None)]),
                   "servers": [{"ready_s": 2.46, "memory": {"peak_rss_bytes": 1.234e9, "peak_pss_bytes": 0.9e9}}]},
        "llama-server": {"status": "ok", "result": _result([(1, 94.9, 80.0, 7.9)], failed=1),
                         "long_result": _result([(1, 0.1, 7500.0, None)]), "long_note": "its own server (-np 1)"},
        "vllm": {"status": "failed", "reason": "exited with 1 while starting: RuntimeError: no AVX512"},
        "hf": {"status": "unavailable", "reason": "transformers is not installed"},
    }
    lines = bt.summary_table(entries, 2000).splitlines()
    assert _cells(lines[0]) == ["system", "c=1 tok/s (TTFT / TPOT ms)", "c=8 tok/s (TTFT / TPOT ms)",
                                "2,000-token prompt TTFT", "ready", "peak RSS (PSS)", "note"]
    rows = {_cells(ln)[0]: _cells(ln)[1:] for ln in lines[2:]}
    assert rows["kvseal unified"] == ["49.2 (120 / 18.8)", "150.0 (1,600 / 40.0)", "4.20 s", "2.5 s",
                                      "1.23 GB (0.90)", ""]
    assert rows["llama.cpp llama-server -cb"] == [
        "94.9 (80.0 / 7.9)", "—", "7.50 s", "—", "—",
        "c=1: 1 failed, 0 short outputs; long prompt on its own server (-np 1)"]
    assert rows["vLLM CPU bf16 (prefix cache on)"] == [
        "—", "—", "—", "—", "—", "failed: exited with 1 while starting: RuntimeError: no AVX512"]
    assert rows["transformers (static batches)"][-1] == "did not run: transformers is not installed"
    no_long = bt.summary_table({"kvseal": entries["kvseal"]}, None).splitlines()
    assert "prompt TTFT" not in no_long[0] and len(_cells(no_long[2])) == 6


def test_tree_memory_sums_a_process_tree() -> None:
    """A child and its grandchild, 120 MB each: the sampled peak sums both (RSS and PSS), and each one's own
    high-water mark is recorded."""
    from benchmarks.proc_memory import TreeMemory

    hold = "x = bytearray(120 << 20); import sys; sys.stdout.write('up\\n'); sys.stdout.flush(); sys.stdin.read()"
    code = (f"import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', {hold!r}], stdout=subprocess.PIPE, "
            f"stdin=subprocess.PIPE); c.stdout.readline(); {hold}")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    mem = TreeMemory(p.pid, interval=0.05, pss_every=1).start()
    try:
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
        mem.sample()
        got = mem.stop()
    finally:
        p.kill()
        p.wait()
    assert got["processes"] == 2 and got["peak_rss_bytes"] > 240e6 and got["peak_pss_bytes"] > 240e6
    assert got["hwm_sum_bytes"] >= got["peak_rss_bytes"]


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9B45
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni avx_vnni
processor\t: 1
model name\t: AMD EPYC 9B45
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni avx_vnni
"""


def test_cpu_record_and_header() -> None:
    rec = cpu_record.record(CPUINFO, 2, "AVX512", "abc123-dirty", "2025-01-02 03:04:05 UTC")
    assert rec["cpu_model"] == "AMD EPYC 9B45" and rec["cores"] == 2
    assert rec["isa"] == {"avx2": True, "avx512f": True, "avx512_bf16": True, "avx512_vnni": True, "avx_vnni": True,
                          "amx_tile": False, "amx_bf16": False, "amx_int8": False}
    assert rec["torch_cpu_capability"] == "AVX512" and rec["git_commit"] == "abc123-dirty"
    assert cpu_record.header(rec) == (
        "CPU: AMD EPYC 9B45, 2 cores; avx2 avx512f avx512_bf16 avx512_vnni avx_vnni no AMX; "
        "torch capability AVX512; 2025-01-02 03:04:05 UTC; commit abc123-dirty")
    xeon = CPUINFO.replace("avx_vnni", "avx_vnni amx_tile amx_bf16 amx_int8")
    assert "no AMX" not in cpu_record.header(cpu_record.record(xeon, 2, "AVX512", None, "d"))
    assert cpu_record.parse_cpuinfo("") == ("unknown", set())
    live = cpu_record.collect()  # this machine, this checkout
    assert live["cpu_model"] != "unknown" and set(live["isa"]) == set(cpu_record.ISA_FLAGS)
    assert live["torch_cpu_capability"] and live["git_commit"] and live["date"]


def _fake(code: str) -> bl.Launch:
    return bl.Launch((sys.executable, "-c", code))


def test_a_server_that_cannot_start_gives_a_reason(tmp_path: Path) -> None:
    log = str(tmp_path / "s.log")
    with pytest.raises(bl.ServerDidNotStart, match=r"cannot execute /nonexistent/llama-server: No such file"):
        bl.start(bl.Launch(("/nonexistent/llama-server",)), 1, log, 5.0)
    crash = "import sys; print('loading'); print('RuntimeError: needs AVX512', flush=True); sys.exit(3)"
    with pytest.raises(bl.ServerDidNotStart) as e:
        bl.start(_fake(crash), 1, log, 30.0)
    assert e.value.reason == "exited with 3 while starting: RuntimeError: needs AVX512"
    assert "loading" in e.value.log_tail
    # 5 s: time for the child to print its line even on a loaded machine (1 s was not always enough)
    with pytest.raises(bl.ServerDidNotStart, match=r"^not ready after 5 s: still loading$"):
        bl.start(_fake("import time; print('still loading', flush=True); time.sleep(60)"), 1, log, 5.0)


def test_run_records_a_row_for_peers_that_cannot_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The whole runner: llama-server is not built under --peers (its row says so), "vllm" crashes at start
    (its row gives its last line); neither stops the run, both make it exit 1, baselines.json has the CPU."""
    real_launch = bl.launch

    def fake_launch(system: str, port: int, s: Settings, workload: Any = "load") -> bl.Launch:
        if system == "vllm":
            return _fake("import sys; print('ValueError: no oneDNN kernel for this CPU'); sys.exit(1)")
        return real_launch(system, port, s, workload)

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # inherited by every server, so recorded with the run
    monkeypatch.setattr(bl, "launch", fake_launch)
    monkeypatch.setattr(bl, "unavailable", lambda system, s: None if system == "vllm" else unavailable(system, s))
    rc = bl.main(["--systems", "llama-server,vllm", "--peers", str(tmp_path / "peers"), "--out-dir",
                  str(tmp_path / "out"), "--no-plot", "--max-concurrency", "1,8"])
    assert rc == 1
    doc = json.loads((tmp_path / "out" / "baselines.json").read_text())
    ls, vl = doc["systems"]["llama-server"], doc["systems"]["vllm"]
    assert ls["status"] == "unavailable" and "not built" in ls["reason"] and ls["servers"] == []
    assert (vl["status"] == "failed"
            and vl["reason"] == "exited with 1 while starting: ValueError: no oneDNN kernel for this CPU")
    assert doc["machine"]["isa"].keys() == set(cpu_record.ISA_FLAGS) and doc["settings"]["slots"] == 8
    assert doc["env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "did not run: not built" in out and "failed: exited with 1" in out
    assert "2,000-token prompt TTFT" in doc["table"]


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

    doc = {"systems": {"kvseal": {"result": result(30.0)}, "llama-server": {"result": result(10.0)}, "hf": {}}}
    path = tmp_path / "baselines.json"
    path.write_text(json.dumps(doc))
    assert bl.main(["--replot", str(path)]) == 0
    png = (tmp_path / "side_by_side.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def _doc(tok: dict[str, float], ttft: dict[str, float], long_ms: dict[str, float]) -> dict[str, Any]:
    def res(s: str) -> dict[str, Any]:
        return _result([(32, tok[s], ttft[s], 10.0), (1, tok[s] / 10, 50.0, {"llama-server": 7.0}.get(s, 5.0))])

    return {"systems": {s: {"result": res(s), "long_result": _result([(1, 1.0, long_ms[s], None)])} for s in tok}}


def test_medians_over_runs_and_the_targets() -> None:
    from benchmarks import baselines_median as bm

    runs = [_doc({"kvseal-disagg": t, "kvseal": 300.0, "vllm": 200.0, "llama-server": 100.0},
                 {"kvseal-disagg": 500.0, "kvseal": 400.0, "vllm": 900.0, "llama-server": 5000.0},
                 {"kvseal-disagg": 1200.0, "kvseal": 900.0, "vllm": 1600.0, "llama-server": 7000.0})
            for t in (310.0, 290.0, 400.0)]
    load, long = bm.collect(runs)
    assert load["kvseal-disagg"]["c=32"]["output_tok_s"] == [310.0, 290.0, 400.0]
    lines = bm.targets(load, long)
    # the median (310), not the best run (400): 310 / 200 = 1.55x the best peer, and a lower TTFT
    assert any(ln.startswith("c=32: kvseal disagg") and "1.55x vLLM" in ln and "-> met" in ln for ln in lines)
    assert any(ln.startswith("c=32: kvseal unified") and "1.50x" in ln and "-> met" in ln for ln in lines)
    assert any("TPOT 5.0 ms vs llama-server 7.0 ms" in ln and "-> met" in ln for ln in lines)
    # 1.2 s against vLLM's 1.6 s is not half of it; 0.9 s is not either
    assert all("NOT met" in ln for ln in lines if ln.startswith("2,000-token"))
    assert any("disaggregated / unified = 1.03 -> met" in ln for ln in lines)
    assert "**310.0** (310.0, 290.0, 400.0)" in bm.table(load, long)

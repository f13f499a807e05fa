"""kvseal against other servers of the same model, one after another, with the same `kvseal bench` load.

    python -m kvseal.bench.baselines                                   # all four, c = 1,4,16,32
    python -m kvseal.bench.baselines --systems kvseal,hf --num-prompts 32 -- --warmup 2

Systems (docs/baselines.md), each started on a free loopback port, waited for, measured, and stopped
before the next one starts, so they never share the CPU:
  kvseal          `kvseal serve --unified` (one process)
  kvseal-disagg   `kvseal serve --prefill 1 --decode 1` (router + prefill + decode processes)
  kvseal-torch    `kvseal serve --unified --kernels torch` (torch ops on dequantized float32 weights)
  llama.cpp       llama-cpp-python's OpenAI server on the GGUF itself (Q4_1 weights), via
                  kvseal.bench.llamacpp_server (token-id prompts accepted); it serves one request at a time
  hf              kvseal.bench.hf_server: transformers with static batching
The load is `python -m kvseal bench --base-url URL --dataset fixed --input-len I --output-len O
--num-prompts N --max-concurrency C --result-json ... [--plot ...]`, plus whatever follows `--`.
Each system's JSON goes to --out-dir/<system>.json; all of them, the commands and the side-by-side table
(output tok/s, median TTFT, median TPOT per concurrency) go to --out-dir/baselines.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvseal.bench.common import ManagedServer, fmt_num, free_port, markdown_table

SYSTEMS: dict[str, str] = {
    "kvseal": "kvseal unified",
    "kvseal-disagg": "kvseal disagg 1P+1D",
    "kvseal-torch": "kvseal unified --kernels torch",
    "llama.cpp": "llama-cpp-python",
    "hf": "transformers",
}
# Where each server says it is ready (llama-cpp-python has no /health).
READY_PATH = {"kvseal": "/health", "kvseal-disagg": "/health", "kvseal-torch": "/health", "llama.cpp": "/v1/models", "hf": "/health"}
METRICS = [("output tok/s", "output_tok_s", 1), ("median TTFT (ms)", "ttft_median_ms", 1),
           ("median TPOT (ms)", "tpot_median_ms", 1)]


@dataclass(frozen=True)
class Settings:
    """What every server gets: the same model file, dtype (for the two that dequantize) and CPU threads."""

    model_path: str
    served_name: str = "SmolLM2-135M-Instruct"
    dtype: str = "float32"
    threads: int | None = None  # None: kvseal's and torch's own choice; llama.cpp gets os.cpu_count()
    n_ctx: int = 8192
    max_batch: int = 32
    wait_timeout: float = 3600.0
    explicit_model: bool = False  # pass model_path to kvseal/hf too (else they load the bundled default)


def server_command(system: str, port: int, s: Settings, python: str = sys.executable) -> list[str]:
    """The argv that starts `system` on 127.0.0.1:port."""
    model = [s.model_path] if s.explicit_model else []
    threads = ["--threads", str(s.threads)] if s.threads else []
    if system in ("kvseal", "kvseal-disagg", "kvseal-torch"):
        mode = {"kvseal": ["--unified"], "kvseal-disagg": ["--prefill", "1", "--decode", "1"],
                "kvseal-torch": ["--unified", "--kernels", "torch"]}[system]
        return [python, "-m", "kvseal", "serve", *model, *mode, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", s.dtype, "--served-model-name", s.served_name, "--wait-timeout", f"{s.wait_timeout:g}",
                "--log-level", "warning", *threads]
    if system == "llama.cpp":
        n = str(s.threads or os.cpu_count() or 1)
        # interrupt_requests=false: by default a new request cuts off the one being streamed.
        # logits_all=false: the server's default (true) keeps logits of every prompt position, which only
        # logprobs need. n_threads defaults to half the cores, n_threads_batch to all of them.
        return [python, "-m", "kvseal.bench.llamacpp_server", "--model", s.model_path,
                "--model_alias", s.served_name, "--host", "127.0.0.1", "--port", str(port),
                "--n_ctx", str(s.n_ctx), "--n_threads", n, "--n_threads_batch", n,
                "--interrupt_requests", "false", "--logits_all", "false", "--verbose", "false"]
    if system == "hf":
        return [python, "-m", "kvseal.bench.hf_server", *model, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", s.dtype, "--max-batch", str(s.max_batch), "--served-model-name", s.served_name,
                "--max-model-len", str(s.n_ctx), "--log-level", "warning", *threads]
    raise ValueError(f"unknown system {system!r}; one of {', '.join(SYSTEMS)}")


def bench_command(base_url: str, result_json: str, *, input_len: int, output_len: int, num_prompts: int,
                  concurrency: str, plot: str | None, extra: Sequence[str] = (),
                  python: str = sys.executable) -> list[str]:
    """The `kvseal bench` argv for one system; `extra` comes last, so it can override any flag."""
    cmd = [python, "-m", "kvseal", "bench", "--base-url", base_url, "--dataset", "fixed",
           "--input-len", str(input_len), "--output-len", str(output_len), "--num-prompts", str(num_prompts),
           "--max-concurrency", concurrency, "--result-json", result_json]
    if plot:
        cmd += ["--plot", plot]
    return [*cmd, *extra]


# -- the combined table ----------------------------------------------------------------------------------


def _level_key(level: dict[str, Any]) -> str:
    c = level.get("max_concurrency")
    if c:
        return f"c={c}"
    rate = level.get("request_rate")
    return "rate=inf" if rate in (None, "inf") or rate == float("inf") else f"rate={rate:g}/s"


def passes_by_level(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A `kvseal bench` result JSON -> {"c=4": metrics, ...} in the order of its passes."""
    return {_level_key(p.get("level") or {}): p.get("metrics") or {} for p in result.get("passes") or []}


def _num(v: Any, digits: int) -> str:
    return fmt_num(None if v is None else float(v), digits)


def build_table(results: dict[str, dict[str, Any] | None]) -> str:
    """One markdown table, a row per (load level, system), the systems of a level next to each other.

    `results` maps a system to its `kvseal bench` JSON (None: the system did not run). Failed requests and
    outputs shorter than asked are listed under the table, since they make a row incomparable."""
    per = {s: passes_by_level(r) if r else {} for s, r in results.items()}
    levels: list[str] = []
    for s in results:
        levels += [lv for lv in per[s] if lv not in levels]
    rows = [[lv, SYSTEMS.get(s, s), *(_num(per[s][lv].get(key), d) for _, key, d in METRICS)]
            for lv in levels for s in results if lv in per[s]]
    notes = []
    for s, r in results.items():
        if r is None:
            notes.append(f"- {SYSTEMS.get(s, s)}: did not run")
        for lv, m in per[s].items():
            failed, short = m.get("failed") or 0, m.get("short_outputs") or 0
            if failed or short:
                notes.append(f"- {SYSTEMS.get(s, s)} {lv}: {failed} failed, {short} short outputs")
    table = markdown_table(["load", "system", *(name for name, _, _ in METRICS)], rows)
    return table + ("\n\n" + "\n".join(notes) if notes else "")


# -- running ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def running(argv: list[str], port: int, ready_path: str, log_path: str, timeout: float) -> Iterator[ManagedServer]:
    srv = ManagedServer(argv, f"http://127.0.0.1:{port}", ready_path, log_path)
    try:
        srv.wait_ready(timeout)
        yield srv
    finally:
        srv.stop()


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    raw = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in raw:
        i = raw.index("--")
        raw, extra = raw[:i], raw[i + 1:]
    p = argparse.ArgumentParser(prog="python -m kvseal.bench.baselines", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--model", default=None, help="a .gguf (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="kvseal's and transformers' dtype (llama.cpp runs the GGUF's own quantized weights)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for every server (default: theirs)")
    p.add_argument("--n-ctx", type=int, default=8192, help="context window of llama.cpp and hf_server")
    p.add_argument("--max-batch", type=int, default=32, help="hf_server's largest batch")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", default="1,4,16,32")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--out-dir", default="bench_out/baselines")
    p.add_argument("--plot", action=argparse.BooleanOptionalAction, default=None,
                   help="a plot per system (default: when matplotlib is installed)")
    a = p.parse_args(raw)
    a.system_list = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = [s for s in a.system_list if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    return a, extra


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def side_by_side_plot(results: dict[str, dict[str, Any] | None], path: str) -> None:
    """One PNG: output tok/s, median TTFT and median TPOT against concurrency, a line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for system, r in results.items():
        if not r:
            continue
        passes = [(int((p.get("level") or {}).get("max_concurrency") or 0), p.get("metrics") or {})
                  for p in r.get("passes") or []]
        passes = sorted((c, m) for c, m in passes if c > 0)
        for ax, (title, key, _) in zip(axes, METRICS, strict=True):
            ax.plot([c for c, _ in passes], [m.get(key) for _, m in passes], marker="o",
                    label=SYSTEMS.get(system, system))
            ax.set_title(title)
            ax.set_xlabel("concurrent streams")
            ax.set_xscale("log", base=2)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--replot"]:  # redraw the side-by-side plot of a finished run: --replot DIR/baselines.json
        done = json.loads(Path(argv[1]).read_text())
        out = str(Path(argv[1]).with_name("side_by_side.png"))
        side_by_side_plot({s: e.get("result") for s, e in done["systems"].items()}, out)
        print(out)
        return 0
    a, extra = parse_args(argv)
    from kvseal.model.loader import DEFAULT_MODEL_NAME, default_model_path

    settings = Settings(model_path=a.model or default_model_path(), dtype=a.dtype, threads=a.threads,
                        n_ctx=a.n_ctx, max_batch=a.max_batch, explicit_model=a.model is not None,
                        served_name=Path(a.model).stem if a.model else DEFAULT_MODEL_NAME)
    plot = _has_matplotlib() if a.plot is None else a.plot
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"started": time.strftime("%F %T"), "settings": asdict(settings),
                           "bench_extra_args": extra, "systems": {}}
    results: dict[str, dict[str, Any] | None] = {}
    failures = 0

    def save() -> None:
        (out_dir / "baselines.json").write_text(json.dumps(doc, indent=1))

    for system in a.system_list:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        stem = system.replace(".", "")
        result_path = out_dir / f"{stem}.json"
        with contextlib.suppress(FileNotFoundError):
            result_path.unlink()  # never report a previous run's numbers
        srv_cmd = server_command(system, port, settings)
        b_cmd = bench_command(url, str(result_path), input_len=a.input_len, output_len=a.output_len,
                              num_prompts=a.num_prompts, concurrency=a.max_concurrency,
                              plot=str(out_dir / f"{stem}.png") if plot else None, extra=extra)
        entry: dict[str, Any] = {"label": SYSTEMS[system], "server_command": srv_cmd, "bench_command": b_cmd,
                                 "server_log": str(out_dir / f"{stem}.server.log")}
        doc["systems"][system] = entry
        print(f"== {system}: {' '.join(srv_cmd)}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            with running(srv_cmd, port, READY_PATH[system], entry["server_log"], a.ready_timeout) as srv:
                entry["ready_s"] = round(time.monotonic() - t0, 1)
                print(f"   ready in {entry['ready_s']}s; {' '.join(b_cmd)}", file=sys.stderr, flush=True)
                entry["bench_exit"] = subprocess.run(b_cmd, check=False).returncode
            entry["server_exit"] = srv.p.returncode
        except (RuntimeError, TimeoutError, OSError) as e:
            entry["error"] = str(e)[-3000:]
            print(f"   {system} failed: {str(e)[-1500:]}", file=sys.stderr, flush=True)
        if result_path.is_file():
            entry["result"] = results[system] = json.loads(result_path.read_text())
        else:
            results[system] = None
        if entry.get("error") or entry.get("bench_exit") or results[system] is None:
            failures += 1
        save()
    doc["finished"] = time.strftime("%F %T")
    doc["table"] = build_table(results)
    save()
    if plot:
        side_by_side_plot(results, str(out_dir / "side_by_side.png"))
    print(doc["table"])
    print(f"\nJSON: {out_dir / 'baselines.json'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""kvseal against the servers people deploy: one after another, on the same machine, in the same run, with the same
token-exact prompts and the same `kvseal bench` load.

    python -m benchmarks.baselines                  # kvseal x3, llama-server, vLLM, transformers
    python -m benchmarks.baselines --systems kvseal,llama-server --num-prompts 32 -- --warmup 2

How each system is started: benchmarks.systems; set-up, flags and caveats: docs/baselines.md. The peers are
built by `bash scripts/setup_baselines.sh` under $PEERS (default ~/.cache/kvseal-peers).

For each system: start it on a free loopback port, wait until it is ready, run two workloads with `kvseal bench`
(always `--dataset fixed --fresh-prompts`: prompts of exactly N random token ids, none sent twice):
  load   --input-len I --output-len O --num-prompts N --max-concurrency 1,4,16,32
  long   --input-len 2000 --output-len 1 --num-prompts 1 --max-concurrency 1   (time to first token)
then stop it (SIGTERM to its process group, SIGKILL after 30 s), so no two servers share the CPU. Every system gets
the same two extra columns: ready (seconds from starting its process to the first 200 on /health, or /v1/models
for llama-cpp-python, which has no /health) and its peak memory (RSS, and PSS, summed over its process tree from
start to stop: benchmarks.proc_memory). A system that
cannot start (not built, crash at start, not ready in time) gets a row that says why; the others still run, and
the exit code is 1 when any system did not run or any request failed.

Output in --out-dir: <system>.json and <system>.long.json (kvseal bench's results), <system>.*.server.log, and
baselines.json: the CPU record (model, ISA flags, torch's capability, date, commit), every command, readiness
times, exit codes, results and both tables. The table printed at the end is headed by the CPU record.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import cpu_record
from benchmarks.baselines_table import build_table, side_by_side_plot, summary_table
from benchmarks.common import ManagedServer, free_port
from benchmarks.proc_memory import TreeMemory
from benchmarks.systems import (
    DEFAULT_SYSTEMS,
    SYSTEMS,
    Launch,
    Settings,
    Workload,
    default_peers_dir,
    launch,
    long_variant,
    slot_ctx_for,
    unavailable,
)

# Environment variables that change how the servers run (OpenMP's spinning, thread counts): recorded with the run.
INHERITED_ENV = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "KMP_BLOCKTIME", "PEERS")


class ServerDidNotStart(Exception):
    """A server that could not be executed, exited while starting, or was not ready in time."""

    def __init__(self, reason: str, log_tail: str = "") -> None:
        super().__init__(reason)
        self.reason, self.log_tail = reason, log_tail


def _last_line(text: str) -> str:
    return next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")[:300]


def start(how: Launch, port: int, log_path: str, timeout: float) -> tuple[ManagedServer, TreeMemory]:
    """The server, ready, and the sampler of its memory (started with the process); or ServerDidNotStart with a
    one-line reason (its last line of output in it)."""
    try:
        srv = ManagedServer(list(how.argv), f"http://127.0.0.1:{port}", how.ready_path, log_path, env=dict(how.env))
    except OSError as e:
        raise ServerDidNotStart(f"cannot execute {how.argv[0]}: {e.strerror or e}") from e
    memory = TreeMemory(srv.p.pid).start()
    try:
        srv.wait_ready(timeout)
    except (RuntimeError, TimeoutError) as e:
        memory.stop()
        code = srv.stop()
        tail = srv.output()[-3000:]
        what = f"not ready after {timeout:g} s" if isinstance(e, TimeoutError) else f"exited with {code} while starting"
        last = _last_line(tail)
        raise ServerDidNotStart(f"{what}: {last}" if last else what, tail) from e
    return srv, memory


def bench_command(base_url: str, result_json: str, *, input_len: int, output_len: int, num_prompts: int,
                  concurrency: str, plot: str | None, extra: Sequence[str] = (),
                  prompts_per_level: str | None = None, python: str = sys.executable) -> list[str]:
    """The `kvseal bench` argv for one workload; `extra` comes last, so it can override any flag."""
    cmd = [python, "-m", "kvseal", "bench", "--base-url", base_url, "--dataset", "fixed",
           "--input-len", str(input_len), "--output-len", str(output_len), "--num-prompts", str(num_prompts),
           "--max-concurrency", concurrency, "--fresh-prompts", "--result-json", result_json]
    if prompts_per_level:
        cmd += ["--prompts-per-level", prompts_per_level]
    if plot:
        cmd += ["--plot", plot]
    return [*cmd, *extra]


def workload_commands(a: argparse.Namespace, extra: Sequence[str], url: str, out_dir: Path, stem: str,
                      plot: bool) -> dict[Workload, tuple[Path, list[str]]]:
    """{workload: (its result JSON, its kvseal bench argv)}; no "long" when --long-input-len is 0."""
    load = out_dir / f"{stem}.json"
    out: dict[Workload, tuple[Path, list[str]]] = {"load": (load, bench_command(
        url, str(load), input_len=a.input_len, output_len=a.output_len, num_prompts=a.num_prompts,
        concurrency=a.max_concurrency, plot=str(out_dir / f"{stem}.png") if plot else None, extra=extra,
        prompts_per_level=a.prompts_per_level))}
    if a.long_input_len:
        long = out_dir / f"{stem}.long.json"
        out["long"] = (long, bench_command(url, str(long), input_len=a.long_input_len, output_len=a.long_output_len,
                                           num_prompts=a.long_num_prompts, concurrency="1", plot=None, extra=extra))
    return out


def run_system(system: str, s: Settings, a: argparse.Namespace, extra: Sequence[str], out_dir: Path,
               plot: bool) -> dict[str, Any]:
    """Start, measure and stop one system; its record for baselines.json (status "ok", "unavailable" or
    "failed" with a one-line reason)."""
    entry: dict[str, Any] = {"label": SYSTEMS[system], "status": "ok", "servers": []}
    reason = unavailable(system, s)
    if reason:
        entry.update(status="unavailable", reason=reason)
        print(f"== {system}: cannot run here: {reason}", file=sys.stderr, flush=True)
        return entry
    stem = system.replace(".", "")
    separate = long_variant(system, s)
    workloads: list[Workload] = ["load", "long"] if a.long_input_len else ["load"]
    groups = [[w] for w in workloads] if separate else [workloads]  # workloads that share one server start
    if separate and a.long_input_len:
        entry["long_note"] = f"its own server ({separate})"
    for group in groups:
        port = free_port()
        how = launch(system, port, s, group[0])
        server: dict[str, Any] = {"workloads": group, "command": list(how.argv), "env": dict(how.env),
                                  "log": str(out_dir / f"{stem}.{group[0]}.server.log")}
        entry["servers"].append(server)
        print(f"== {system} ({', '.join(group)}): {' '.join(how.argv)}", file=sys.stderr, flush=True)
        t0 = time.monotonic()  # "ready": from starting the process to its first 200 on how.ready_path
        try:
            srv, memory = start(how, port, server["log"], a.ready_timeout)
        except ServerDidNotStart as e:
            server["error"] = e.log_tail
            entry.update(status="failed", reason=e.reason)
            print(f"   {system} did not start: {e.reason}", file=sys.stderr, flush=True)
            break
        server["ready_s"] = round(time.monotonic() - t0, 2)
        print(f"   ready in {server['ready_s']}s", file=sys.stderr, flush=True)
        try:
            cmds = workload_commands(a, extra, srv.url, out_dir, stem, plot)
            for w in group:
                result_path, cmd = cmds[w]
                with contextlib.suppress(FileNotFoundError):
                    result_path.unlink()  # never report a previous run's numbers
                print(f"   {w}: {' '.join(cmd)}", file=sys.stderr, flush=True)
                rc = subprocess.run(cmd, check=False).returncode
                entry[f"{w}_bench_command"], entry[f"{w}_bench_exit"] = cmd, rc
                if result_path.is_file():
                    entry["result" if w == "load" else "long_result"] = json.loads(result_path.read_text())
                elif entry["status"] == "ok":
                    entry.update(status="failed", reason=f"{w}: kvseal bench exited with {rc} and wrote no result")
        finally:
            server["memory"] = memory.stop()
            server["exit"] = srv.stop()
    return entry


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    raw = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in raw:
        i = raw.index("--")
        raw, extra = raw[:i], raw[i + 1:]
    p = argparse.ArgumentParser(prog="python -m benchmarks.baselines", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma list of {', '.join(SYSTEMS)} (default: all but llama-cpp-python)")
    p.add_argument("--model", default=None, help="a .gguf (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="kvseal's and transformers' dtype (llama.cpp runs the GGUF's Q4_1 weights, vLLM bfloat16)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for every server (default: theirs)")
    p.add_argument("--n-ctx", type=int, default=8192, help="context window (llama-server's for the long prompt)")
    p.add_argument("--max-batch", type=int, default=32, help="hf_server's largest batch")
    p.add_argument("--slots", type=int, default=None,
                   help="llama-server -np for the load (default: the largest --max-concurrency)")
    p.add_argument("--peers", default=default_peers_dir(),
                   help="where scripts/setup_baselines.sh put the peers (default: $PEERS or ~/.cache/kvseal-peers)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", default="1,4,16,32")
    p.add_argument("--prompts-per-level", default=None,
                   help="the load's prompts at each --max-concurrency level, e.g. 16,32,64 (the long workload "
                        "keeps --long-num-prompts)")
    p.add_argument("--long-input-len", type=int, default=2000,
                   help="prompt tokens of the long-prompt TTFT workload (0: skip it)")
    p.add_argument("--long-output-len", type=int, default=1)
    p.add_argument("--long-num-prompts", type=int, default=1, help="long prompts, sent one at a time")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--out-dir", default="bench_out/baselines")
    p.add_argument("--plot", action=argparse.BooleanOptionalAction, default=None,
                   help="a plot per system (default: when matplotlib is installed)")
    a = p.parse_args(raw)
    a.system_list = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = [s for s in a.system_list if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    try:
        a.concurrency_list = [int(c) for c in a.max_concurrency.split(",")]
    except ValueError:
        p.error(f"--max-concurrency: expected a comma list of whole numbers, got {a.max_concurrency!r}")
    if a.long_input_len and a.long_input_len + a.long_output_len > a.n_ctx:
        p.error(f"--long-input-len {a.long_input_len} + --long-output-len {a.long_output_len} does not fit "
                f"--n-ctx {a.n_ctx}: raise --n-ctx or lower --long-input-len")
    return a, extra


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def settings_from(a: argparse.Namespace) -> Settings:
    from kvseal.model.locate import DEFAULT_MODEL_NAME, default_model_path

    return Settings(model_path=a.model or default_model_path(), dtype=a.dtype, threads=a.threads, n_ctx=a.n_ctx,
                    max_batch=a.max_batch, explicit_model=a.model is not None,
                    served_name=Path(a.model).stem if a.model else DEFAULT_MODEL_NAME, peers_dir=a.peers,
                    slots=a.slots or max(a.concurrency_list), slot_ctx=slot_ctx_for(a.input_len, a.output_len))


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
    settings = settings_from(a)
    plot = _has_matplotlib() if a.plot is None else a.plot
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = cpu_record.collect()
    print(cpu_record.header(machine), file=sys.stderr, flush=True)
    env = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}  # every server inherits these
    doc: dict[str, Any] = {"started": time.strftime("%F %T"), "machine": machine, "env": env,
                           "settings": asdict(settings),
                           "workloads": {"load": {"input_len": a.input_len, "output_len": a.output_len,
                                                  "num_prompts": a.num_prompts, "max_concurrency": a.max_concurrency},
                                         "long": {"input_len": a.long_input_len, "output_len": a.long_output_len,
                                                  "num_prompts": a.long_num_prompts}},
                           "bench_extra_args": extra, "systems": {}}

    def save() -> None:
        (out_dir / "baselines.json").write_text(json.dumps(doc, indent=1))

    for system in a.system_list:
        doc["systems"][system] = run_system(system, settings, a, extra, out_dir, plot)
        save()
    entries: dict[str, dict[str, Any]] = doc["systems"]
    doc["finished"] = time.strftime("%F %T")
    doc["table"] = summary_table(entries, a.long_input_len or None)
    doc["detail_table"] = build_table({s: e.get("result") for s, e in entries.items()})
    save()
    if plot:
        side_by_side_plot({s: e.get("result") for s, e in entries.items()}, str(out_dir / "side_by_side.png"))
    print(f"{cpu_record.header(machine)}\n\n{doc['table']}\n\n{doc['detail_table']}")
    print(f"\nJSON: {out_dir / 'baselines.json'}")
    failed = [s for s, e in entries.items()
              if e["status"] != "ok" or any(e.get(f"{w}_bench_exit") for w in ("load", "long"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

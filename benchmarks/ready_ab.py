"""Ready time of a cached start, alternated: llama-server and `kvseal serve` (unified and the fleet) from this checkout
and, with --base, from another revision's package, one start after another, round after round, the order rotating.

    python -m benchmarks.ready_ab --model qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --base d8f2bed --rounds 5

Ready = seconds from spawning the server to its first 200 on /health (polled every 20 ms), as benchmarks.baselines
measures it, and the CPU seconds (user + system) its process tree had used by then; the server is then stopped
(SIGTERM to its process group) before the next one starts. Every side gets a warm-up start first (its kernels
compiled, its weights cache built, in a weights cache folder of its own: the cache's name carries the kernels'
version), so every timed start is a cached one. llama-server runs as the issue-32 table ran it (`-np 32 -cb -c
65536`, every core). On a shared machine the load average is printed with every start: compare medians of alternated
rounds, and say the load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import cpu_record
from benchmarks.common import checkout, free_port, tree_cpu_s
from benchmarks.systems import Settings

REPO = Path(__file__).resolve().parents[1]


class Died(RuntimeError):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def start_timed(argv: list[str], env: dict[str, str], tries: int = 3) -> tuple[float, float]:
    """ready_once on a free port, started again (up to `tries` times) when a signal from outside stopped it before
    it was ready: on a shared machine another session's clean-up may kill a server by name."""
    for attempt in range(tries):
        port = free_port()
        try:
            return ready_once([*argv, "--port", str(port)], env, port)
        except Died as e:
            if e.code >= 0 or attempt == tries - 1:
                raise
            print(f"  {argv[0]} killed by signal {-e.code} before it was ready; starting it again", flush=True)
    raise AssertionError("unreachable")


def ready_once(argv: list[str], env: dict[str, str], port: int, timeout: float = 300.0) -> tuple[float, float]:
    """(seconds from spawn to the first 200 on /health, the process tree's CPU seconds by then); the server is
    stopped before returning."""
    import httpx

    t0 = time.monotonic()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                    return time.monotonic() - t0, tree_cpu_s(p.pid)
            except httpx.HTTPError:
                pass
            if p.poll() is not None:
                raise Died(f"{argv[:4]} exited with {p.returncode} before it was ready", p.returncode)
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{argv[:4]} not ready after {timeout:g} s")
            time.sleep(0.02)
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def sides(a: argparse.Namespace, tmp: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (argv without --port, environment)."""
    out: dict[str, tuple[list[str], dict[str, str]]] = {}
    s = Settings(model_path=a.model)
    if os.access(s.llama_server, os.X_OK):
        n = str(os.cpu_count() or 1)
        out["llama-server"] = ([str(s.llama_server), "-m", a.model, "--host", "127.0.0.1", "-t", n, "-tb", n, "-np",
                                "32", "-cb", "-c", "65536"], dict(os.environ))
    trees = [("", REPO)] + ([(f" @{a.base}", checkout(a.base, tmp / "base"))] if a.base else [])
    for tag, tree in trees:
        # PYTHONSAFEPATH: `python -m` would put the working directory (this checkout) ahead of PYTHONPATH, in the
        # server and in every worker it starts
        env = dict(os.environ, PYTHONPATH=str(tree), PYTHONSAFEPATH="1",
                   KVSEAL_WEIGHTS_CACHE_DIR=str(tmp / f"weights{len(out)}"))
        for mode, flags in (("unified", ["--unified"]), ("fleet", ["--prefill", "1", "--decode", "1"])):
            if mode in a.modes:
                out[f"kvseal {mode}{tag}"] = ([sys.executable, "-m", "kvseal", "serve", a.model, *flags, "--host",
                                               "127.0.0.1", "--log-level", "warning"], env)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ready_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GGUF file (a name in ~/.cache/kvseal/models, or a path)")
    p.add_argument("--base", default=None, help="a git revision whose kvseal is started too")
    p.add_argument("--modes", default="unified,fleet")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not os.path.exists(a.model):
        a.model = str(Path.home() / ".cache" / "kvseal" / "models" / a.model)
    with tempfile.TemporaryDirectory(prefix="kvseal-ready-") as tmp:
        runs = sides(a, Path(tmp))
        for cmd, env in runs.values():  # warm-up: kernels built, weights caches written, files in the page cache
            port = free_port()
            ready_once([*cmd, "--port", str(port)], env, port, timeout=1800.0)
        times: dict[str, list[float]] = {n: [] for n in runs}
        cpus: dict[str, list[float]] = {n: [] for n in runs}
        loads: list[float] = []
        names = list(runs)
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # the order rotates round by round
                cmd, env = runs[name]
                loads.append(os.getloadavg()[0])
                wall, cpu = start_timed(cmd, env)
                times[name].append(wall)
                cpus[name].append(cpu)
                print(f"round {r + 1} {name}: {wall:.2f} s, {cpu:.2f} CPU s (load {loads[-1]:.1f})", flush=True)
    med = {n: statistics.median(t) for n, t in times.items()}
    cmed = {n: statistics.median(t) for n, t in cpus.items()}
    ref, cref = med.get("llama-server"), cmed.get("llama-server")
    print(cpu_record.header(cpu_record.collect()))
    print(f"load average during the runs: {min(loads):.1f} to {max(loads):.1f}")
    for n, m in med.items():
        print(f"{n:28s} ready median {m:5.2f} s" + (f" ({m / ref:.2f}x llama-server)" if ref else "") +
              f", CPU {cmed[n]:5.2f} s" + (f" ({cmed[n] / cref:.2f}x)" if cref else ""))
    if a.json:
        res: dict[str, Any] = {"cpu": cpu_record.collect(), "model": a.model, "base": a.base, "times": times,
                               "cpu_s": cpus, "medians": med, "cpu_medians": cmed, "loads": loads}
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a cached `kvseal serve --unified` start is made of: the CPU seconds of each phase up to `uvicorn.run`, for this
checkout and, with --base, another revision's package, in fresh processes alternated round by round; medians.

    python -m benchmarks.start_phases --model qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --base main --rounds 3

Each run is `kvseal serve MODEL --unified` in a child that wraps the engine's steps with timestamps (imports, the
checkpoint and tokenizer, the model, the KV pool, the HTTP app) and stops where uvicorn would start serving. Each
side has a weights cache folder of its own (built by a first, untimed run), so every timed start is a cached one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import cpu_record
from benchmarks.common import checkout

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
marks = [("interpreter", time.process_time())]
def mark(name): marks.append((name, time.process_time()))
import uvicorn
class Stop(Exception): pass
def at_uvicorn(app, **kw):
    mark("HTTP app"); raise Stop
uvicorn.run = at_uvicorn
from kvseal.cli import main
mark("import kvseal.cli (every parser)")
import kvseal.engine.engine as E
mark("import torch and the engine")
init, load, llama = E.Engine.__init__, E.load_checkpoint, E.LlamaModel
def engine(self, *a, **k):
    mark("configs"); init(self, *a, **k); mark("KV pool and the rest of the engine")
def checkpoint(*a, **k):
    r = load(*a, **k); mark("checkpoint: GGUF header, tokenizer"); return r
def model(*a, **k):
    mark("kernels"); r = llama(*a, **k); mark("model (weights cache mapped)"); return r
E.Engine.__init__, E.load_checkpoint, E.LlamaModel = engine, checkpoint, model
try:
    main(sys.argv[1:])
except Stop:
    pass
print(json.dumps([(n, t - p) for (n, t), (_, p) in zip(marks, [("", 0.0)] + marks)]))
"""


def run_once(tree: Path, model: str, cache: Path) -> list[tuple[str, float]]:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONSAFEPATH="1", KVSEAL_WEIGHTS_CACHE_DIR=str(cache))
    out = subprocess.run([sys.executable, "-c", CHILD, "serve", model, "--unified", "--port", "1", "--log-level",
                          "warning"], env=env, capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
    return [(str(n), float(t)) for n, t in json.loads(out.stdout.strip().splitlines()[-1])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.start_phases", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GGUF file (a name in ~/.cache/kvseal/models, or a path)")
    p.add_argument("--base", default=None, help="a git revision whose kvseal is measured too")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    if not os.path.exists(a.model):
        a.model = str(Path.home() / ".cache" / "kvseal" / "models" / a.model)
    with tempfile.TemporaryDirectory(prefix="kvseal-phases-") as tmp:
        trees = {"this checkout": REPO}
        if a.base:
            trees = {f"@{a.base}": checkout(a.base, Path(tmp) / "base"), **trees}
        caches = {n: Path(tmp) / f"weights{i}" for i, n in enumerate(trees)}
        for n, tree in trees.items():  # untimed: kernels compiled, weights cache built
            run_once(tree, a.model, caches[n])
        runs: dict[str, list[list[tuple[str, float]]]] = {n: [] for n in trees}
        for r in range(a.rounds):
            for n in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                runs[n].append(run_once(trees[n], a.model, caches[n]))
    print(f"{cpu_record.header(cpu_record.collect())}; CPU seconds, medians of {a.rounds}")
    names = [n for n, _ in next(iter(runs.values()))[0]]
    print(f"{'phase':40s}" + "".join(f"{n:>16s}" for n in runs))
    totals = {n: 0.0 for n in runs}
    for i, phase in enumerate(names):
        meds = {n: statistics.median(run[i][1] for run in rs) for n, rs in runs.items()}
        for n, m in meds.items():
            totals[n] += m
        print(f"{phase:40s}" + "".join(f"{m:16.2f}" for m in meds.values()))
    print(f"{'total':40s}" + "".join(f"{t:16.2f}" for t in totals.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

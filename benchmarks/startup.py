"""How long a model takes to load and how much memory it takes, against reading its file.

    python -m benchmarks.startup load  --model FILE [--arithmetic auto] [--repeats 3]
    python -m benchmarks.startup serve --model FILE [--disagg]

load: interleaved, `--repeats` times, each in a fresh process: `cat FILE > /dev/null` with the file evicted from
  the page cache (cold) and again (warm); then kvseal's load (load_checkpoint + the model's weights in the chosen
  arithmetic, i.e. everything before the KV pool) on its first start (an empty weights cache folder: the file is
  hashed and the cache built) and on later starts, cold (file and cache evicted) and warm. Medians, the ratio to
  reading the file, the load's CPU time (user + system, all threads: what it costs when the machine is shared)
  and each load process's peak RSS. Eviction is posix_fadvise(DONTNEED); the share of the file
  still resident afterwards (mincore) is reported, since pages another process maps cannot be evicted.
serve: `kvseal serve --unified` (or, with --disagg, 1 prefill + 1 decode), its process tree's memory sampled from
  start to stop (benchmarks.proc_memory): ready time, then --streams concurrent requests of a 128-token prompt and
  32 tokens out, so that every weight and some KV is touched, then RSS and PSS per process and their peaks, against
  the target 1.15 x (file + KV pool) + 500 MiB.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import free_port

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
import torch
from kvseal.config import ModelConfig
from kvseal.engine.devices import resolve_device
from kvseal.kernels.arithmetic import resolve_arithmetic
from kvseal.kernels.build import resolve
from kvseal.model.llama import LlamaModel
from kvseal.model.loader import load_checkpoint
t1, c1 = time.perf_counter(), time.process_time()
ck = load_checkpoint(sys.argv[1], progress=False)
t2 = time.perf_counter()
kernels, why = resolve("auto", "cpu", "float32", ck.arch)
arith = resolve_arithmetic(sys.argv[2], kernels, why, ck.arch, 16, ck.block_types())
m = LlamaModel(ck, torch.float32, torch.device("cpu"), native=kernels == "native", fast=arith.fast, progress=False)
t3, c3 = time.perf_counter(), time.process_time()
print(json.dumps({"import_s": t1 - t0, "checkpoint_s": t2 - t1, "model_s": t3 - t2, "load_s": t3 - t1,
                  "load_cpu_s": c3 - c1,
                  "arithmetic": arith.name, "built": m.weights_cache_built,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def resident_fraction(path: str) -> float:
    """The share of the file's pages in the page cache (mincore over a fresh map; mapping faults nothing in)."""
    import numpy as np

    size = os.path.getsize(path)
    if not size:
        return 0.0
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    arr = np.frombuffer(m, dtype=np.uint8)
    try:
        addr = arr.__array_interface__["data"][0]
        if ctypes.CDLL(None, use_errno=True).mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
    finally:
        del arr
        m.close()
    return sum(v & 1 for v in vec) / pages


def evict(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def time_cat(path: str) -> float:
    t = time.perf_counter()
    subprocess.run(["cat", path], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def load_once(model: str, arithmetic: str, cache_dir: str) -> dict[str, Any]:
    env = {**os.environ, "KVSEAL_WEIGHTS_CACHE_DIR": cache_dir}
    out = subprocess.run([sys.executable, "-c", CHILD, model, arithmetic], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_load(a: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ("cat_cold", "cat_warm", "first", "later_cold",
                                                            "later_warm")}
    residue: list[float] = []
    for _ in range(a.repeats):
        evict(a.model)
        residue.append(resident_fraction(a.model))
        runs["cat_cold"].append({"load_s": time_cat(a.model)})
        runs["cat_warm"].append({"load_s": time_cat(a.model)})
        fresh = tempfile.mkdtemp(prefix="kvseal-startup-")
        try:
            evict(a.model)
            runs["first"].append(load_once(a.model, a.arithmetic, fresh))
            for f in Path(fresh).glob("*.bin"):
                evict(f)
            evict(a.model)
            runs["later_cold"].append(load_once(a.model, a.arithmetic, fresh))
            runs["later_warm"].append(load_once(a.model, a.arithmetic, fresh))
        finally:
            shutil.rmtree(fresh, ignore_errors=True)
    med = {k: statistics.median(r["load_s"] for r in v) for k, v in runs.items()}
    rows = [f"| {k} | {med[k]:.2f} s | {med[k] / med['cat_cold']:.2f} | {med[k] / med['cat_warm']:.2f} | "
            + (f"{statistics.median(r['load_cpu_s'] for r in v):.2f} s | "
               f"{statistics.median(r['peak_rss'] for r in v) / 1e9:.2f} GB |" if "peak_rss" in v[0] else "— | — |")
            for k, v in runs.items()]
    table = "\n".join(["| what | median | / cat cold | / cat warm | CPU time | peak RSS |", "|---|---|---|---|---|---|",
                       *rows])
    return {"model": a.model, "size": os.path.getsize(a.model), "runs": runs, "medians_s": med, "table": table,
            "resident_after_evict": residue, "arithmetic": runs["first"][0]["arithmetic"]}


def _get(url: str) -> Any:
    import httpx

    return httpx.get(url, timeout=30).json()


def bench_serve(a: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.baselines import start
    from benchmarks.systems import Launch

    port = free_port()
    mode = ["--prefill", "1", "--decode", "1"] if a.disagg else ["--unified"]
    argv = [sys.executable, "-m", "kvseal", "serve", a.model, *mode, "--port", str(port), "--log-level", "warning",
            *(["--max-model-len", str(a.max_model_len)] if a.max_model_len else [])]
    log = tempfile.NamedTemporaryFile(prefix="kvseal-startup-", suffix=".log", delete=False).name  # noqa: SIM115
    t0 = time.monotonic()
    srv, memory = start(Launch(tuple(argv)), port, log, 900.0)
    ready = time.monotonic() - t0
    try:
        info = _get(srv.url + "/info")
        bench = [sys.executable, "-m", "kvseal", "bench", "--base-url", srv.url, "--dataset", "fixed", "--input-len",
                 "128", "--output-len", "32", "--num-prompts", str(a.streams), "--max-concurrency", str(a.streams),
                 "--fresh-prompts"]
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
        memory.sample()
        per_process = [(p.pid, " ".join(p.cmdline()[2:5]), p.memory_info().rss, p.memory_full_info().pss)
                       for p in _tree(srv.p.pid)]
    finally:
        mem = memory.stop()
        srv.stop()
    return {"argv": argv, "ready_s": ready, "memory": mem, "per_process": per_process, "info": info,
            "size": os.path.getsize(a.model)}


def _tree(pid: int) -> list[Any]:
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["load", "serve"])
    p.add_argument("--model", required=True)
    p.add_argument("--arithmetic", default="auto", choices=["auto", "exact", "fast"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--disagg", action="store_true", help="serve: 1 prefill + 1 decode instead of --unified")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--streams", type=int, default=4, help="serve: concurrent requests (128 tokens in, 32 out)")
    p.add_argument("--out", default=None, help="write the result JSON here")
    a = p.parse_args(argv)
    result = bench_load(a) if a.what == "load" else bench_serve(a)
    text = json.dumps(result, indent=1, default=str)
    if a.out:
        Path(a.out).write_text(text)
    print(result.get("table") or text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

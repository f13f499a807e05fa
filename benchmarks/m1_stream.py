"""One decode token's products (M = 1) over every layer of a GGUF file, from memory: two kernel builds alternated token
by token, set against the read bandwidth measured in the same run, the same way.

    python -m benchmarks.m1_stream --model qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --base main --threads 1

A "token" multiplies one row of x by every layer's matrices in the model's order (q|k|v, o, gate|up, down) and the
output matrix, the engine's own packed tiles mapped from its weights cache (so in the page cache's pages, large
folios where the file system gives them, as a server reads them): about 1 GB for the 1.5B, more than the caches
hold, so every weight comes from memory as in a decode step. Timed in thread CPU time with --threads 1 (a shared
machine's queue does not count; memory stalls do), or wall time with more threads. The bandwidth: torch's sum of
--bw-mb of float32 in 2 MB pages (benchmarks.limits.read_bandwidth), timed the same way, between tokens. The outputs
of the two builds must be equal bit for bit.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import cpu_record
from benchmarks.kernels_ab import build_revision, load
from benchmarks.limits import read_bandwidth
from kvseal.kernels import build, ops
from kvseal.kernels.weights import QWeight


def model_matrices(model: str) -> list[tuple[str, QWeight]]:
    """Every product of a decode step, as the engine holds them: the fast arithmetic's packed tiles, mapped from
    the weights cache (built on first use), in the order a step runs them."""
    from kvseal.model.llama import LlamaModel
    from kvseal.model.loader import load_checkpoint

    m = LlamaModel(load_checkpoint(model, progress=False), torch.float32, torch.device("cpu"), native=True,
                   fast=True, progress=False, max_model_len=512)
    mats = [(f"{i}.{n}", w) for i, ly in enumerate(m.layers)
            for n, w in (("qkv", ly.wqkv), ("o", ly.wo), ("gate_up", ly.w_gate_up), ("down", ly.w_down))]
    mats.append(("output", m.lm_head))
    if not all(isinstance(w, QWeight) for _, w in mats):
        raise ValueError(f"{model}: not every matrix is packed for the fast arithmetic")
    return mats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.m1_stream", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GGUF file (a name in ~/.cache/kvseal/models, or a path)")
    p.add_argument("--base", required=True, help="the git revision whose kernels are the 'before' side")
    p.add_argument("--tokens", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bw-mb", type=int, default=1024)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not Path(a.model).exists():
        a.model = str(Path.home() / ".cache" / "kvseal" / "models" / a.model)
    # a weights cache of its own: the cache's name carries the kernels' version, and this checkout's would replace
    # the shared folder's for every other process that loads the same file
    os.environ.setdefault("KVSEAL_WEIGHTS_CACHE_DIR", str(Path(tempfile.gettempdir()) / "kvseal-m1-stream-weights"))
    torch.set_num_threads(a.threads)
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    mats = model_matrices(a.model)
    nbytes = sum(w.nbytes for _, w in mats)
    descs = [(ops.mat_desc(w), w) for _, w in mats]
    kmax = max(w.k for _, w in mats)
    xs = {k: torch.randn(1, k, generator=torch.Generator().manual_seed(k)) for k in {w.k for _, w in mats}}
    with tempfile.TemporaryDirectory() as tmp:
        libs = [load(build_revision(a.base, Path(tmp)), a.threads), load(build.build(), a.threads)]
        isas = [ops.QISA_NAMES.get(lib.kvs_qisa(), "?") for lib in libs]
        scratch = [torch.empty(int(lib.kvs_qscratch_bytes(1, kmax)), dtype=torch.uint8) for lib in libs]
        ys = [[torch.empty(1, w.n) for _, w in mats] for _ in libs]

        def token(i: int) -> float:
            lib, sc = libs[i], scratch[i].data_ptr()
            t = clock()
            for (desc, w), y in zip(descs, ys[i], strict=True):
                if lib.kvs_qlinear_mat(ctypes.byref(desc), w.k, xs[w.k].data_ptr(), 1, y.data_ptr(), sc):
                    raise RuntimeError("kvs_qlinear_mat failed")
            return clock() - t

        def bw() -> float:
            return read_bandwidth(a.bw_mb, clock, rounds=2)[0]

        token(0), token(1)  # warm-up
        ts: list[list[float]] = [[], []]
        bws: list[float] = []
        for r in range(a.tokens):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                ts[i].append(token(i))
            bws.append(bw())
        same = all(torch.equal(y0, y1) for y0, y1 in zip(*ys, strict=True))
    rec = cpu_record.collect()
    best = max(bws)
    res: dict[str, Any] = {"cpu": rec, "base": a.base, "isa": isas, "threads": a.threads, "bytes": nbytes,
                           "ms": ts, "bw": bws, "same_bits": same}
    print(f"{cpu_record.header(rec)}; {a.threads} thread(s), {'thread CPU' if a.threads == 1 else 'wall'} time")
    print(f"{len(mats)} matrices, {nbytes / 1e6:.0f} MB a token; read bandwidth: best {best / 1e9:.1f} GB/s, "
          f"median {statistics.median(bws) / 1e9:.1f}")
    for name, t, isa in ((f"before ({a.base})", ts[0], isas[0]), ("after (this checkout)", ts[1], isas[1])):
        m = statistics.median(t)
        print(f"{name:24s} {isa:12s} {m * 1e3:7.1f} ms a token (min {min(t) * 1e3:.1f})  {nbytes / m / 1e9:5.1f} GB/s  "
              f"{nbytes / m / best:4.0%} of the best bandwidth")
    print(f"after/before: {statistics.median(ts[0]) / statistics.median(ts[1]):.3f}x; same bits: {same}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The fast arithmetic's products of two kernel builds, alternated call by call on a real GGUF file's matrices:
before and after a kernel change, measured in the same run against the peaks measured in that run.

    python -m benchmarks.kernels_ab --model qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --base d8f2bed --threads 1

--base REV: the kernels of git revision REV (kvseal/kernels/*.c, *.h at REV, compiled with build.FLAGS into a
temporary folder); the other side is this checkout's. Each side runs with its own instruction-set choice
(KVSEAL_QISA applies to both). For each M of --rows and each matrix of one layer (q|k|v and gate|up fused as the
model runs them, o, down), the two builds are called one after the other, --seconds per cell, timed in thread CPU
time (time spent descheduled on a shared machine does not count; memory stalls do), medians; the outputs must be
equal bit for bit (the arithmetic is the same). Rates are G multiply-adds a second and % of the measured int8
vector peak (512-bit vpdpbusd where the CPU has it, else 256-bit vpmaddubsw) times the threads.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import cpu_record
from benchmarks.limits import peak_rates
from kvseal.kernels import build, ops
from kvseal.kernels.weights import PackedWeight, QWeight

_MATS = (("q|k|v", ("attn_q", "attn_k", "attn_v")), ("o", ("attn_output",)), ("gate|up", ("ffn_gate", "ffn_up")),
         ("down", ("ffn_down",)))


def build_revision(rev: str, out: Path) -> Path:
    """The kernels library of git revision rev, compiled with this checkout's flags."""
    repo = Path(__file__).resolve().parents[1]
    src = out / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "kvseal/kernels"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    kdir = src / "kvseal" / "kernels"
    lib = out / f"libkvseal_{rev}.so"
    cc = build.compiler() or "cc"
    subprocess.run([cc, *build.FLAGS, "-o", str(lib), *map(str, sorted(kdir.glob("*.c"))), "-lm"], check=True)
    return lib


def load(path: Path, threads: int) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))  # RTLD_LOCAL: its symbols stay its own
    lib.kvs_qlinear_mat.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_void_p]
    lib.kvs_qscratch_bytes.argtypes, lib.kvs_qscratch_bytes.restype = [ctypes.c_int64, ctypes.c_int64], ctypes.c_int64
    lib.kvs_set_threads.argtypes = [ctypes.c_int]
    lib.kvs_qisa.restype = ctypes.c_int
    lib.kvs_set_threads(threads)
    return lib


def layer_matrices(model: str, layer: int) -> list[tuple[str, QWeight]]:
    from kvseal.model.gguf_file import GGUFFile

    f = GGUFFile(model)
    out = []
    for name, parts in _MATS:
        ws = []
        for p in parts:
            info = f.tensor(f"blk.{layer}.{p}.weight")
            n, k = info.rows_cols
            data = f.tensor_bytes(info).clone().view(n, -1)  # out of the map: no page-cache effects
            ws.append(PackedWeight(int(info.tensor_type), n, k, data))
        out.append((name, QWeight.pack(*ws)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GGUF file")
    p.add_argument("--base", required=True, help="the git revision whose kernels are the 'before' side")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--rows", default="1,8,16,32,128,512")
    p.add_argument("--seconds", type=float, default=3.0, help="per cell, both sides together")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rates = peak_rates()
    int8 = next(n for n in ("512-bit int8 vpdpbusd", "256-bit int8 vpmaddubsw") if n in rates)
    peak = rates[int8] * a.threads / 1e9
    with tempfile.TemporaryDirectory() as tmp:
        libs = [load(build_revision(a.base, Path(tmp)), a.threads), load(build.build(), a.threads)]
        isas = [ops.QISA_NAMES.get(lib.kvs_qisa(), "?") for lib in libs]
        res: dict[str, Any] = {"cpu": cpu_record.collect(), "base": a.base, "threads": a.threads, "isa": isas,
                               "int8_peak": int8, "int8_peak_GMACs": peak, "cells": []}
        print(f"{cpu_record.header(res['cpu'])}; {a.threads} thread(s); thread CPU time, medians")
        print(f"int8 peak ({int8}) {peak:.0f} G MAC/s; before: {a.base} on {isas[0]}, after: this checkout on "
              f"{isas[1]}")
        mats = layer_matrices(a.model, a.layer)
        print(f"{'M':>5}  " + "  ".join(f"{name + ' before/after':>28}" for name, _ in mats))
        for m in (int(r) for r in a.rows.split(",")):
            cells = []
            for name, w in mats:
                cells.append(cell(libs, w, m, a.seconds, peak))
                res["cells"].append({"m": m, "matrix": name, **cells[-1]})
            print(f"{m:>5}  " + "  ".join(
                f"{c['before']:5.0f} ({c['before'] / peak:3.0%}) {c['after']:5.0f} ({c['after'] / peak:3.0%}) "
                f"{c['after'] / c['before']:4.2f}x" + ("" if c["same_bits"] else " DIFFER") for c in cells))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


def cell(libs: list[ctypes.CDLL], w: QWeight, m: int, seconds: float, peak: float) -> dict[str, Any]:
    x = torch.randn(m, w.k, generator=torch.Generator().manual_seed(m))
    desc = ops.mat_desc(w)
    ys = [torch.empty(m, w.n) for _ in libs]
    scratch = [torch.empty(int(lib.kvs_qscratch_bytes(m, w.k)), dtype=torch.uint8) for lib in libs]
    ts: list[list[float]] = [[], []]
    end = time.time() + seconds
    while time.time() < end or len(ts[0]) < 3:
        for i, lib in enumerate(libs):
            t = time.thread_time()
            rc = lib.kvs_qlinear_mat(ctypes.byref(desc), w.k, x.data_ptr(), m, ys[i].data_ptr(),
                                     scratch[i].data_ptr())
            ts[i].append(time.thread_time() - t)
            if rc:
                raise RuntimeError(f"kvs_qlinear_mat returned {rc}")
    before, after = (m * w.n * w.k / statistics.median(t) / 1e9 for t in ts)
    return {"before": before, "after": after, "calls": len(ts[0]), "same_bits": bool(torch.equal(*ys))}


if __name__ == "__main__":
    raise SystemExit(main())

"""The matrix kernels alone, on a real GGUF file's own tensors (no model, no engine): how far they are from
this machine's limits.

    python -m benchmarks.kernels_gguf --model ~/.cache/kvseal/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf

1. This machine: streaming read bandwidth (torch sum of 1 GB, every thread), one core's peak of the int8
   multiply-add (512-bit vpdpbusd where the CPU has AVX-512-VNNI, else 256-bit vpmaddubsw), of the AMX int8 tile
   product where the CPU has AMX (benchmarks.limits.peak_rates), and of vfmadd231ps (float32), times the threads.
2. Correctness on the file's blocks: per block type, a slice of a real tensor dequantized equals gguf-py's
   bit for bit, and the exact and fast products agree with a float64 product (relative error).
3. One decode token (M = 1): every layer's q|k|v, o, gate|up and down (fused as the model runs them, mixed types
   as row segments) and the lm_head, in order: ms per token and GB/s of weights streamed, for the fast arithmetic
   (repacked tiles) and the exact one (GGUF rows dequantized in registers), against the read bandwidth.
4. M = 1..512 rows: G multiply-adds per second of the fast arithmetic over --layers layers, per matrix (q|k|v,
   o, gate|up, down) and in all, against the int8 vector peak (and the AMX tile peak where there is one).
5. Mixed types: q|k|v (q, k Q4_K; v Q6_K in half the layers) as one fused call against one call per matrix.
Medians of --repeat runs. --cpu-time times with the process's CPU time instead of the wall clock: on a machine
shared with other work, with --threads 1, it gives what one core does (memory stalls count; time spent
descheduled does not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from benchmarks import cpu_record
from benchmarks.limits import peak_rates
from kvseal.kernels import ops
from kvseal.kernels.weights import BLOCKS, TYPE_NAMES, PackedWeight, QWeight, fuse_rows

_MATS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


CLOCK = time.perf_counter


def median_s(f: Callable[[], object], n: int) -> float:
    f()
    ts = []
    for _ in range(n):
        t = CLOCK()
        f()
        ts.append(CLOCK() - t)
    return statistics.median(ts)


def read_bandwidth(repeat: int) -> float:
    x = torch.ones(256 * 2**20)  # 1 GB: far past the caches
    return x.numel() * 4 / median_s(x.sum, repeat) / 1e9


def packed(t: Any) -> PackedWeight:
    """A GGUF tensor's rows as stored (copied out of the map: the benchmark must not depend on the page cache)."""
    n, k = int(t.shape[1]), int(t.shape[0])
    data = torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(n, -1))
    return PackedWeight(int(t.tensor_type), n, k, data)


def check_blocks(tensors: dict[str, Any]) -> list[dict[str, Any]]:
    """Per block type in the file: 64 rows of one tensor, dequantized against gguf-py, products against float64."""
    seen: dict[int, str] = {}
    for name, t in tensors.items():
        if len(t.shape) == 2 and int(t.tensor_type) in BLOCKS:
            seen.setdefault(int(t.tensor_type), name)
    out = []
    for qtype, name in sorted(seen.items()):
        t = tensors[name]
        rows = np.array(t.data[:64], dtype=np.uint8)
        w = PackedWeight(qtype, rows.shape[0], int(t.shape[0]), torch.from_numpy(rows.reshape(rows.shape[0], -1)))
        ref = torch.from_numpy(np.asarray(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(qtype)),
                                          dtype=np.float32).reshape(w.n, w.k))
        x = torch.randn(8, w.k, generator=torch.Generator().manual_seed(0))
        exact = x.double() @ ref.double().T
        rel = [float((y.double() - exact).norm() / exact.norm()) for y in
               (ops.packed_linear(x, w), ops.qlinear(x, QWeight.pack(w)))]
        out.append({"type": TYPE_NAMES[qtype], "tensor": name,
                    "dequant_bit_exact": bool(torch.equal(w.dequantize(), ref)),
                    "exact_rel_err": rel[0], "fast_rel_err": rel[1]})
    return out


def layer_weights(tensors: dict[str, Any], layers: range) -> list[list[list[PackedWeight]]]:
    return [[[packed(tensors[f"blk.{i}.{m}.weight"]) for m in mat] for mat in _MATS] for i in layers]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels_gguf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GGUF file")
    p.add_argument("--layers", type=int, default=4, help="layers for the M = 32..512 rates")
    p.add_argument("--rows", default="1,8,16,32,128,512")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cpu-time", action="store_true", help="time with process CPU time (use with --threads 1)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    if a.threads:
        torch.set_num_threads(a.threads)
    ops.match_torch_threads()
    threads = torch.get_num_threads()
    res: dict[str, Any] = {"cpu": cpu_record.collect(), "model": Path(a.model).name, "threads": threads,
                           "isa": ops.qisa(), "clock": "process CPU time" if a.cpu_time else "wall"}
    res["read_GBps"] = bw = read_bandwidth(a.repeat)
    rates = peak_rates()
    int8_name = next(n for n in ("512-bit int8 vpdpbusd", "256-bit int8 vpmaddubsw") if n in rates)
    res["int8_peak_GMACs"] = peak = rates[int8_name] * threads / 1e9
    res["int8_peak_instruction"] = int8_name
    amx = rates.get("AMX int8 tdpbssd (16x16x64)")
    res["amx_int8_peak_GMACs"] = amx_peak = amx * threads / 1e9 if amx else None
    res["fp32_peak_GMACs"] = max(rates.get(n, 0.0) for n in ("512-bit fp32 vfmadd231ps", "256-bit fp32 vfmadd231ps")
                                 ) * threads / 1e9
    print(f"{cpu_record.header(res['cpu'])}; {threads} threads; fast arithmetic on {res['isa']}; {res['clock']}")
    print(f"read bandwidth {bw:.1f} GB/s; peak int8 ({int8_name}) {peak:.0f} G MAC/s"
          + (f", AMX int8 tiles {amx_peak:.0f} G MAC/s" if amx_peak else ", no AMX")
          + f" ({threads} cores at one core's issue rate)")

    reader = gguf.GGUFReader(a.model)
    tensors = {t.name: t for t in reader.tensors}
    res["checks"] = check_blocks(tensors)
    for c in res["checks"]:
        print(f"  {c['type']:5} ({c['tensor']}): dequantization bit-exact vs gguf-py: {c['dequant_bit_exact']}; "
              f"relative error vs float64: exact {c['exact_rel_err']:.1e}, fast {c['fast_rel_err']:.1e}")

    nl = int(gguf_field(a.model, "block_count"))
    ws = layer_weights(tensors, range(nl))
    head = packed(tensors["output.weight" if "output.weight" in tensors else "token_embd.weight"])
    fast = [[QWeight.pack(*parts) for parts in layer] for layer in ws]
    fhead = QWeight.pack(head)
    exact = [[fuse_rows(parts) for parts in layer] for layer in ws]
    step_bytes = sum(q.nbytes for layer in fast for q in layer) + fhead.nbytes
    gguf_bytes = sum(p.nbytes for layer in ws for parts in layer for p in parts) + head.nbytes
    macs = sum(q.n * q.k for layer in fast for q in layer) + fhead.n * fhead.k
    xs = {k: torch.randn(512, k) for k in {q.k for layer in fast for q in layer} | {fhead.k}}

    def token(kind: str, m: int = 1, layers: int = nl) -> None:
        for layer in (fast if kind == "fast" else exact)[:layers]:
            for w in layer:
                x = xs[w.k][:m]
                ops.qlinear(x, w) if kind == "fast" else ops.packed_linear(x, w)  # type: ignore[arg-type]
        if layers == nl:
            x = xs[fhead.k][:m]
            ops.qlinear(x, fhead) if kind == "fast" else ops.packed_linear(x, head)

    print(f"\nM = 1, one token through {nl} layers + lm_head: {gguf_bytes / 1e6:.0f} MB as GGUF blocks, "
          f"{step_bytes / 1e6:.0f} MB repacked, {macs / 1e9:.2f} G multiply-adds")
    for kind, nbytes in (("fast", step_bytes), ("exact", gguf_bytes)):
        t = median_s(lambda: token(kind), a.repeat)  # noqa: B023 - used at once
        res[f"m1_{kind}_ms"] = t * 1e3
        print(f"  {kind:5}: {t * 1e3:6.1f} ms/token, {nbytes / t / 1e9:5.1f} GB/s ({nbytes / t / 1e9 / bw:.0%} of "
              f"the read bandwidth; at the bandwidth: {nbytes / bw / 1e6:.1f} ms)")

    sub = min(a.layers, nl)
    names = ("q|k|v", "o", "gate|up", "down")
    mat_macs = [sum(layer[j].n * layer[j].k for layer in fast[:sub]) for j in range(4)]
    print(f"\nfast arithmetic, {sub} layers, G multiply-adds/s per matrix and in all, % of the int8 peak "
          f"{peak:.0f}" + (f" (in all: and of the AMX peak {amx_peak:.0f})" if amx_peak else "") + ":")
    print(f"  {'M':>5}  " + "  ".join(f"{n:>14}" for n in (*names, "all")))
    res["rates"] = {}
    for m in (int(r) for r in a.rows.split(",")):
        reps = max(3, a.repeat // 2)
        ts = [median_s(lambda: [ops.qlinear(xs[layer[j].k][:m], layer[j]) for layer in fast[:sub]], reps)  # noqa: B023
              for j in range(4)]
        rates_m = [mat_macs[j] * m / ts[j] / 1e9 for j in range(4)]
        total = sum(mat_macs) * m / sum(ts) / 1e9
        res["rates"][m] = {**dict(zip(names, rates_m, strict=True)), "all": total}
        cells = [f"{r:6.1f} ({r / peak:4.0%})" for r in (*rates_m, total)]
        print(f"  {m:>5}  " + "  ".join(f"{c:>14}" for c in cells)
              + (f"  AMX {total / amx_peak:.0%}" if amx_peak else ""))

    print("\nq|k|v fused (one call, row segments of mixed types) vs one call per matrix, all layers:")
    res["fused"] = {}
    split = [[QWeight.pack(p) for p in layer[0]] for layer in ws]
    types = sorted({"|".join(TYPE_NAMES[p.qtype] for p in layer[0]) for layer in ws})
    for m in (1, 32):
        x = xs[fast[0][0].k][:m]
        t_f = median_s(lambda: [ops.qlinear(x, layer[0]) for layer in fast], a.repeat)  # noqa: B023
        t_s = median_s(lambda: [[ops.qlinear(x, w) for w in parts] for parts in split], a.repeat)  # noqa: B023
        res["fused"][m] = {"fused_ms": t_f * 1e3, "split_ms": t_s * 1e3}
        print(f"  M = {m:2} ({', '.join(types)}): fused {t_f * 1e3:.2f} ms, split {t_s * 1e3:.2f} ms "
              f"({t_s / t_f:.2f}x)")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


def gguf_field(path: str, suffix: str) -> Any:
    """A metadata value under the file's architecture (e.g. block_count), read by kvseal's own GGUF parser."""
    from kvseal.model.gguf_file import GGUFFile

    f = GGUFFile(path)
    return f.field(f"{f.field('general.architecture')}.{suffix}")


if __name__ == "__main__":
    raise SystemExit(main())

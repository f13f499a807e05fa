"""This machine's limits for a decode step, measured with torch: the figures docs/benchmarks.md compares against.

    python -m benchmarks.limits [--threads 2]

Streaming read bandwidth (sum of a 512 MB fp32 tensor), fp32 matrix-vector products over ~530 MB of weights
in SmolLM2-135M's layer shape (what one decode stream reads per step), fp32 / bf16 GEMM rate, one core's peak of
each multiply-add instruction the CPU has (512-bit vpdpbusd / vfmadd231ps / vdpbf16ps, 256-bit vpmaddubsw, AMX
int8 and bf16 tile products where the CPU has them and the OS grants them), and every layer
matrix of the bundled model multiplied by M rows three ways: the fast arithmetic's int8 products on the Q4_1
blocks, torch's bf16 GEMM (oneDNN; AMX or AVX-512-BF16 where the CPU has them) on a bf16 copy, and fp32.
Medians of 7.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import statistics
import time
from collections.abc import Callable

import torch


def median_s(f: Callable[[], object], n: int = 7) -> float:
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def huge_floats(nbytes: int) -> tuple[torch.Tensor, mmap.mmap]:
    """Ones in anonymous memory the kernel is asked to back with 2 MB pages (MADV_HUGEPAGE; THP "madvise" mode gives
    them only on request), and the map that must outlive the tensor. A decode step reads the weights cache through
    the page cache, which ext4 and tmpfs hold in large folios: 4 KB pages (torch.ones) stop the hardware
    prefetcher at every page and cost a TLB miss each, about 20% of a core's read rate on Sapphire Rapids."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):
        m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.float32)
    t.fill_(1.0)
    return t, m


def read_bandwidth(mb: int, clock: Callable[[], float], rounds: int = 5) -> tuple[float, float]:
    """(best, median) bytes a second of torch's sum over `mb` MB of float32 in 2 MB pages (huge_floats), with
    torch's threads, timed by `clock` (time.thread_time for one thread on a shared machine)."""
    x, m = huge_floats(mb * 2**20)
    x.sum()
    ts = []
    for _ in range(rounds):
        t = clock()
        x.sum()
        ts.append(clock() - t)
    del x
    m.close()
    return mb * 2**20 / min(ts), mb * 2**20 / statistics.median(ts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.limits", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from benchmarks import cpu_record

    print(cpu_record.header(cpu_record.collect()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    x = torch.ones(128 * 2**20)  # 512 MB
    t = median_s(x.sum)
    print(f"read bandwidth (sum of 512 MB fp32): {x.numel() * 4 / t / 1e9:.1f} GB/s")
    print(f"read bandwidth, 2 MB pages (the same sum): {read_bandwidth(512, time.perf_counter)[0] / 1e9:.1f} GB/s")
    weights = [torch.randn(1536, 576) for _ in range(150)]  # 530 MB in the MLP's shape
    v = torch.randn(1, 576)
    t = median_s(lambda: [torch.nn.functional.linear(v, w) for w in weights])
    print(f"fp32 matrix-vector over 530 MB of weights: {t * 1e3:.1f} ms ({530e6 / t / 1e9:.1f} GB/s)")
    for dtype in (torch.float32, torch.bfloat16):
        m = torch.randn(2048, 2048).to(dtype)
        t = median_s(lambda: m @ m, n=3)  # noqa: B023 - used at once
        print(f"{str(dtype).removeprefix('torch.')} GEMM 2048^3: {2 * 2048**3 / t / 1e9:.1f} GFLOP/s")
    instruction_peaks()
    model_products()
    return 0


# (kvs_peak_issue kind, name, multiply-adds per instruction): 512-bit vector instructions, then AMX tiles
PEAKS = ((0, "512-bit int8 vpdpbusd", 64), (1, "512-bit fp32 vfmadd231ps", 16), (2, "512-bit bf16 vdpbf16ps", 32),
         (3, "256-bit int8 vpmaddubsw", 32), (4, "256-bit fp32 vfmadd231ps", 8),
         (5, "AMX int8 tdpbssd (16x16x64)", 16384), (6, "AMX bf16 tdpbf16ps (16x16x32)", 8192))


def peak_rates(rounds: int = 2_000_000) -> dict[str, float]:
    """One core's multiply-adds a second per instruction of PEAKS this CPU has (best of 3, thread CPU time)."""
    from kvseal.kernels.weights import lib

    out = {}
    for kind, name, macs in PEAKS:
        if lib().kvs_peak_issue(kind, 1) < 0:
            continue
        n_rounds = rounds if kind < 5 else rounds // 200  # a tile product takes ~16 cycles
        best = 0.0
        for _ in range(3):
            t = time.thread_time()
            n = lib().kvs_peak_issue(kind, n_rounds)
            best = max(best, n / (time.thread_time() - t))
        out[name] = best * macs
    return out


def instruction_peaks() -> None:
    """One core's issue rate of the multiply-add instructions (12 independent ones in a loop; AMX: 4 tiles)."""
    rates = peak_rates()
    for _, name, _ in PEAKS:
        print(f"one core, {name}: " + (f"{rates[name] / 1e9:.0f} G multiply-adds/s" if name in rates
                                         else "not on this CPU (or AMX not granted to this process)"))


def model_products(rows: tuple[int, ...] = (1, 8, 32, 128, 512)) -> None:
    """All 210 layer matrices of the bundled model times (M, K) rows: int8 (fast arithmetic) vs bf16 vs fp32."""
    from kvseal.kernels.ops import qisa, qlinear
    from kvseal.kernels.weights import PackedWeight, QWeight
    from kvseal.model.loader import load_checkpoint

    ck = load_checkpoint(None)
    names = [n for n in ck.packed if ".layers." in n]
    blocks = [ck.packed[n] for n in names]
    q = [QWeight.pack(PackedWeight(b.qtype, b.n, b.k, b.blocks_in_order())) for b in blocks]
    dense = [b.dequantize() for b in blocks]
    bf = [w.to(torch.bfloat16) for w in dense]
    macs = sum(w.numel() for w in dense)
    print(f"every layer matrix of the bundled model ({macs / 1e6:.0f} M weights; int8 reads "
          f"{sum(w.nbytes for w in q) / 1e6:.0f} MB, bf16 {macs * 2 / 1e6:.0f} MB, fp32 {macs * 4 / 1e6:.0f} MB) "
          f"times M rows, G multiply-adds/s (int8 on {qisa()}):")
    for m in rows:
        xs = {k: torch.randn(m, k) for k in {w.shape[1] for w in dense}}
        xb = {k: x.to(torch.bfloat16) for k, x in xs.items()}
        ti = median_s(lambda: [qlinear(xs[w.k], w) for w in q])  # noqa: B023 - used at once
        tb = median_s(lambda: [torch.nn.functional.linear(xb[w.shape[1]], w) for w in bf])  # noqa: B023
        tf = median_s(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in dense])  # noqa: B023
        print(f"  M={m:4d}: int8 {m * macs / ti / 1e9:6.1f}  bf16 {m * macs / tb / 1e9:6.1f}  "
              f"fp32 {m * macs / tf / 1e9:6.1f}   (int8 / bf16 = {tb / ti:.2f}x)")


if __name__ == "__main__":
    raise SystemExit(main())

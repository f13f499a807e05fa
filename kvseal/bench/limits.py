"""This machine's limits for a decode step, measured with torch: the figures docs/benchmarks.md compares against.

    python -m kvseal.bench.limits [--threads 2]

Streaming read bandwidth (sum of a 512 MB fp32 tensor), fp32 matrix-vector products over ~530 MB of weights
in SmolLM2-135M's layer shape (what one decode stream reads per step), and fp32 / bf16 GEMM rate. Medians of 7.
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvseal.bench.limits", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    x = torch.ones(128 * 2**20)  # 512 MB
    t = median_s(x.sum)
    print(f"read bandwidth (sum of 512 MB fp32): {x.numel() * 4 / t / 1e9:.1f} GB/s")
    weights = [torch.randn(1536, 576) for _ in range(150)]  # 530 MB in the MLP's shape
    v = torch.randn(1, 576)
    t = median_s(lambda: [torch.nn.functional.linear(v, w) for w in weights])
    print(f"fp32 matrix-vector over 530 MB of weights: {t * 1e3:.1f} ms ({530e6 / t / 1e9:.1f} GB/s)")
    for dtype in (torch.float32, torch.bfloat16):
        m = torch.randn(2048, 2048).to(dtype)
        t = median_s(lambda: m @ m, n=3)  # noqa: B023 - used at once
        print(f"{str(dtype).removeprefix('torch.')} GEMM 2048^3: {2 * 2048**3 / t / 1e9:.1f} GFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

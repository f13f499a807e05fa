"""What `kvseal bench` computes and prints with no torch in sight: percentiles, per-request latency, tables and
the client machine. The studies in the repository's benchmarks/ use the same functions (benchmarks/common.py)."""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence
from typing import Any


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


Arrivals = list[tuple[float, int]]  # (monotonic arrival time, tokens in that chunk/delta)


def request_latency(t_send: float, arrivals: Arrivals, num_tokens: int | None = None) -> tuple[float, float]:
    """(TTFT, TPOT) of one request. TPOT = (last arrival - first arrival) / (tokens - 1): the mean time per
    output token after the first, as vLLM's benchmark defines it; NaN when only one token came back."""
    if not arrivals:
        return math.nan, math.nan
    n = num_tokens if num_tokens is not None else sum(k for _, k in arrivals)
    ttft = arrivals[0][0] - t_send
    tpot = (arrivals[-1][0] - arrivals[0][0]) / (n - 1) if n > 1 else math.nan
    return ttft, tpot


def fmt_num(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:,.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max([len(str(h)), *(len(str(r[i])) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def host_info() -> dict[str, Any]:
    """CPU model, cores, vector ISA, memory and Python: no torch import, so a load generator can call it."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), cpu)
        flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    except OSError:
        flags = []
    return {"cpu": cpu, "cores": os.cpu_count(),
            "isa": sorted({f for f in flags if f.startswith(("avx512", "amx", "avx2", "fma"))}),
            "python": platform.python_version(),
            "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}

"""Medians over several `benchmarks.baselines` runs, and the issue-8 targets as ratios within them.

    python -m benchmarks.baselines_median bench_out/run1 bench_out/run2 bench_out/run3

Each DIR holds a run's baselines.json. For every system and load level the table gives the median (over the
runs that measured it) of output tok/s, median TTFT and median TPOT, with the per-run values; then the
2,000-token prompt's TTFT (the median of each run's median); then the targets, each a ratio of medians:
kvseal (the default `kvseal serve`, disaggregated, and `--unified`) against the best peer at the largest
level, llama-server's TPOT at one stream, vLLM's long-prompt TTFT, and disaggregated against unified.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.baselines_table import _label, markdown_table, passes_by_level

KVSEAL = ("kvseal-disagg", "kvseal")
PEERS = ("llama-server", "vllm", "hf", "llama-cpp-python")


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def collect(docs: list[dict[str, Any]]) -> tuple[dict[str, dict[str, dict[str, list[float]]]], dict[str, list[float]]]:
    """({system: {level: {metric: [per-run values]}}}, {system: [per-run long-prompt TTFT medians in ms]})."""
    load: dict[str, dict[str, dict[str, list[float]]]] = {}
    long: dict[str, list[float]] = {}
    for doc in docs:
        for system, e in doc["systems"].items():
            for level, m in passes_by_level(e.get("result") or {}).items():
                if m.get("failed") or m.get("short_outputs"):
                    continue  # a pass with failed or short answers is no measurement of speed
                cell = load.setdefault(system, {}).setdefault(level, {})
                for key in ("output_tok_s", "ttft_median_ms", "tpot_median_ms"):
                    if m.get(key) is not None:
                        cell.setdefault(key, []).append(float(m[key]))
            for m in passes_by_level(e.get("long_result") or {}).values():
                if m.get("ttft_median_ms") is not None and not m.get("failed"):
                    long.setdefault(system, []).append(float(m["ttft_median_ms"]))
    return load, long


def _fmt(xs: list[float] | None, digits: int) -> str:
    if not xs:
        return "—"
    runs = ", ".join(f"{x:,.{digits}f}" for x in xs)
    return f"**{_med(xs):,.{digits}f}** ({runs})"


def table(load: dict[str, dict[str, dict[str, list[float]]]], long: dict[str, list[float]]) -> str:
    rows = []
    for system, levels in load.items():
        for level, cell in levels.items():
            rows.append([level, _label(system), _fmt(cell.get("output_tok_s"), 1),
                         _fmt(cell.get("ttft_median_ms"), 0), _fmt(cell.get("tpot_median_ms"), 1)])
    rows.sort(key=lambda r: int(r[0].partition("=")[2] or 0))
    out = markdown_table(["load", "system", "output tok/s: median (runs)", "TTFT p50 ms", "TPOT p50 ms"], rows)
    long_rows = [[_label(s), _fmt([x / 1e3 for x in v], 2)] for s, v in long.items()]
    return out + "\n\n" + markdown_table(["system", "2,000-token prompt TTFT s: median (runs)"], long_rows)


def targets(load: dict[str, dict[str, dict[str, list[float]]]], long: dict[str, list[float]]) -> list[str]:
    def med(system: str, level: str, key: str) -> float | None:
        return _med(load.get(system, {}).get(level, {}).get(key, []))

    levels = sorted({lv for s in load.values() for lv in s}, key=lambda lv: int(lv.partition("=")[2] or 0))
    lines = []
    if levels:
        top, one = levels[-1], levels[0]
        peers = [(med(p, top, "output_tok_s"), p) for p in PEERS if med(p, top, "output_tok_s") is not None]
        if peers:
            best_tok, best = max(peers)
            for k in KVSEAL:
                tok, ttft = med(k, top, "output_tok_s"), med(k, top, "ttft_median_ms")
                if tok is None or ttft is None:
                    continue
                ratio, peer_ttft = tok / best_tok, med(best, top, "ttft_median_ms") or float("nan")
                met = ratio >= 1.5 and ttft <= peer_ttft
                lines.append(f"{top}: {_label(k)} {tok:,.1f} tok/s = {ratio:.2f}x {_label(best)} ({best_tok:,.1f}); "
                             f"TTFT p50 {ttft:,.0f} vs {peer_ttft:,.0f} ms -> {'met' if met else 'NOT met'} "
                             f"(target >= 1.5x and TTFT no higher)")
        ls = med("llama-server", one, "tpot_median_ms")
        for k in KVSEAL:
            tpot = med(k, one, "tpot_median_ms")
            if ls is not None and tpot is not None:
                lines.append(f"{one}: {_label(k)} TPOT {tpot:.1f} ms vs llama-server {ls:.1f} ms = {tpot / ls:.2f}x "
                             f"-> {'met' if tpot <= ls else 'NOT met'} (target <= 1x)")
        d, u = med("kvseal-disagg", top, "output_tok_s"), med("kvseal", top, "output_tok_s")
        if d is not None and u is not None:
            lines.append(f"{top}: disaggregated / unified = {d / u:.2f} -> {'met' if d / u >= 0.85 else 'NOT met'} "
                         f"(target >= 0.85)")
    v = _med(long.get("vllm", []))
    for k in KVSEAL:
        t = _med(long.get(k, []))
        if v is not None and t is not None:
            lines.append(f"2,000-token prompt: {_label(k)} TTFT {t / 1e3:.2f} s vs vLLM {v / 1e3:.2f} s = {t / v:.2f}x "
                         f"-> {'met' if t <= v / 2 else 'NOT met'} (target <= 0.5x)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", help="run directories, each with a baselines.json")
    a = p.parse_args(argv)
    docs = [json.loads((Path(d) / "baselines.json").read_text()) for d in a.dirs]
    for d, doc in zip(a.dirs, docs, strict=True):
        m = doc.get("machine") or {}
        print(f"{d}: {m.get('cpu_model', m.get('model', '?'))}, {m.get('date', doc.get('started', '?'))}, "
              f"commit {str(m.get('git_commit', '?'))[:12]}")
    load, long = collect(docs)
    print()
    print(table(load, long))
    print()
    for line in targets(load, long):
        print("- " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

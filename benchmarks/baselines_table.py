"""The baseline run's tables and plot, from `kvseal bench` result JSONs. Pure except the plot.

- `summary_table`: a row per system (every system of the run, also one that could not start: its row says
  why), a column per load level (output tok/s with median TTFT / TPOT), one for the long prompt's TTFT, and
  the system's ready time and peak memory.
- `build_table`: a row per (load level, system) with the three numbers in columns of their own.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import fmt_ms, fmt_num, markdown_table
from benchmarks.systems import SYSTEMS

METRICS = [("output tok/s", "output_tok_s", 1), ("median TTFT (ms)", "ttft_median_ms", 1),
           ("median TPOT (ms)", "tpot_median_ms", 1)]


def _level_key(level: dict[str, Any]) -> str:
    c = level.get("max_concurrency")
    if c:
        return f"c={c}"
    rate = level.get("request_rate")
    return "rate=inf" if rate in (None, "inf") or rate == float("inf") else f"rate={rate:g}/s"


def passes_by_level(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A `kvseal bench` result JSON -> {"c=4": metrics, ...} in the order of its passes."""
    return {_level_key(p.get("level") or {}): p.get("metrics") or {} for p in result.get("passes") or []}


def _num(v: Any, digits: int) -> str:
    return fmt_num(None if v is None else float(v), digits)


def _ms(v: Any) -> str:
    return fmt_ms(None if v is None else float(v) / 1e3)


def _label(system: str) -> str:
    return SYSTEMS.get(system, system)


def _problems(label: str, per_level: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for lv, m in per_level.items():
        failed, short = m.get("failed") or 0, m.get("short_outputs") or 0
        if failed or short:
            out.append(f"{label}{lv}: {failed} failed, {short} short outputs")
    return out


def build_table(results: dict[str, dict[str, Any] | None]) -> str:
    """One markdown table, a row per (load level, system), the systems of a level next to each other.

    `results` maps a system to its `kvseal bench` JSON (None: the system did not run). Failed requests and
    outputs shorter than asked are listed under the table, since they make a row incomparable."""
    per = {s: passes_by_level(r) if r else {} for s, r in results.items()}
    levels: list[str] = []
    for s in results:
        levels += [lv for lv in per[s] if lv not in levels]
    rows = [[lv, _label(s), *(_num(per[s][lv].get(key), d) for _, key, d in METRICS)]
            for lv in levels for s in results if lv in per[s]]
    notes = []
    for s, r in results.items():
        if r is None:
            notes.append(f"- {_label(s)}: did not run")
        notes += [f"- {p}" for p in _problems(_label(s) + " ", per[s])]
    table = markdown_table(["load", "system", *(name for name, _, _ in METRICS)], rows)
    return table + ("\n\n" + "\n".join(notes) if notes else "")


def _long_ttft(result: dict[str, Any] | None) -> str:
    passes = (result or {}).get("passes") or []
    if not passes:
        return "—"
    m = passes[0].get("metrics") or {}
    if not m.get("completed"):
        return "failed"
    v = m.get("ttft_median_ms")
    return "—" if v is None else f"{float(v) / 1e3:,.2f} s"


def _gb(v: Any) -> str:
    return "—" if not v else f"{float(v) / 1e9:.2f}"


def _startup(entry: dict[str, Any]) -> list[str]:
    """[ready, peak memory] of a system: its first server's ready time, the largest peak over its servers."""
    servers = [sv for sv in entry.get("servers") or [] if sv.get("ready_s") is not None]
    if not servers:
        return ["—", "—"]
    peak = max(servers, key=lambda sv: (sv.get("memory") or {}).get("peak_rss_bytes") or 0).get("memory") or {}
    ready = f"{float(servers[0]['ready_s']):.1f} s"
    return [ready, f"{_gb(peak.get('peak_rss_bytes'))} GB ({_gb(peak.get('peak_pss_bytes'))})"]


def summary_table(entries: dict[str, dict[str, Any]], long_input_len: int | None) -> str:
    """A row per system: each load level's `tok/s (TTFT / TPOT ms)`, the long prompt's TTFT, its ready time (first
    server), its peak RSS and PSS (the largest over its servers), and a note (why it did not run, failed or short
    requests, a separate server for the long prompt).

    `entries` maps a system to the runner's record: `status` ("ok", "unavailable", "failed"), `reason`,
    `result` (the load's JSON), `long_result` and `long_note`."""
    per = {s: passes_by_level(e.get("result") or {}) for s, e in entries.items()}
    levels: list[str] = []
    for s in entries:
        levels += [lv for lv in per[s] if lv not in levels]
    headers = ["system", *(f"{lv} tok/s (TTFT / TPOT ms)" for lv in levels)]
    if long_input_len:
        headers.append(f"{long_input_len:,}-token prompt TTFT")
    headers += ["ready", "peak RSS (PSS)", "note"]
    rows = []
    for s, e in entries.items():
        cells = [_label(s)]
        for lv in levels:
            m = per[s].get(lv)
            cells.append("—" if m is None else f"{_num(m.get('output_tok_s'), 1)} "
                                                f"({_ms(m.get('ttft_median_ms'))} / {_ms(m.get('tpot_median_ms'))})")
        notes = []
        if e.get("status") == "unavailable":
            notes.append(f"did not run: {e.get('reason')}")
        elif e.get("status") == "failed":
            notes.append(f"failed: {e.get('reason')}")
        notes += _problems("", per[s])
        if long_input_len:
            long_result = e.get("long_result")
            cells.append(_long_ttft(long_result))
            notes += _problems("long prompt ", passes_by_level(long_result or {}))
            if e.get("long_note"):
                notes.append(f"long prompt on {e['long_note']}")
        rows.append([*cells, *_startup(e), "; ".join(notes)])
    return markdown_table(headers, rows)


def side_by_side_plot(results: dict[str, dict[str, Any] | None], path: str) -> None:
    """One PNG: output tok/s, median TTFT and median TPOT against concurrency, a line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for system, r in results.items():
        if not r:
            continue
        passes = [(int((p.get("level") or {}).get("max_concurrency") or 0), p.get("metrics") or {})
                  for p in r.get("passes") or []]
        passes = sorted((c, m) for c, m in passes if c > 0)
        for ax, (title, key, _) in zip(axes, METRICS, strict=True):
            ax.plot([c for c, _ in passes], [m.get(key) for _, m in passes], marker="o", label=_label(system))
            ax.set_title(title)
            ax.set_xlabel("concurrent streams")
            ax.set_xscale("log", base=2)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

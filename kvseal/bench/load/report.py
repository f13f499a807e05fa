"""What `kvseal bench` shows and writes: the table (one column per pass), the JSON file and the plot."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from kvseal.bench.load.stats import fmt_num, markdown_table

Pass = dict[str, Any]  # {"level": {...}, "metrics": {...}, "errors": {...}[, "requests": [...]]}

_LATENCY_ROWS = [(f"{label} {stat} (ms)", f"{key}_{stat}_ms")
                 for label, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e"))
                 for stat in ("mean", "median", "p99")]


def level_label(level: dict[str, Any], sweep_key: str) -> str:
    if sweep_key == "max_concurrency":
        return f"c={level['max_concurrency']}"
    rate = level["request_rate"]
    return "rate=inf" if math.isinf(rate) else f"rate={rate:g}/s"


def _metric(key: str, digits: int) -> Callable[[Pass], str]:
    def cell(p: Pass) -> str:
        v = p["metrics"][key]
        return fmt_num(None if v is None else float(v), digits)

    return cell


def render_table(passes: Sequence[Pass], sweep_key: str, with_goodput: bool) -> str:
    rows: list[tuple[str, Callable[[Pass], str]]] = [
        ("max concurrency", lambda p: str(p["level"]["max_concurrency"] or "none")),
        ("request rate (req/s)", lambda p: f"{p['level']['request_rate']:g}"),
        ("completed / failed", lambda p: f"{p['metrics']['completed']} / {p['metrics']['failed']}"),
        ("short outputs", lambda p: str(p["metrics"]["short_outputs"])),
        ("cached / input tokens", lambda p: f"{fmt_num(p['metrics'].get('cached_input_tokens'), 0)} / "
                                            f"{p['metrics']['total_input_tokens']}"),
        ("duration (s)", _metric("duration_s", 2)),
        ("requests/s", _metric("request_throughput", 2)),
        ("input tok/s", _metric("input_tok_s", 1)),
        ("output tok/s", _metric("output_tok_s", 1)),
        ("total tok/s", _metric("total_tok_s", 1)),
    ]
    if with_goodput:
        rows.append(("goodput (req/s)", _metric("goodput", 2)))
    rows += [(name, _metric(key, 1)) for name, key in _LATENCY_ROWS]
    headers = ["", *(level_label(p["level"], sweep_key) for p in passes)]
    return markdown_table(headers, [[name, *(cell(p) for p in passes)] for name, cell in rows])


def json_safe(x: Any) -> Any:
    """NaN (an undefined statistic) becomes null and infinity (an unbounded request rate) "inf": plain JSON."""
    if isinstance(x, float):
        return None if math.isnan(x) else ("inf" if math.isinf(x) else x)
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def write_json(path: str, doc: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(json_safe(doc), f, indent=1, allow_nan=False)
        f.write("\n")


def _x_positions(values: Sequence[float]) -> tuple[list[float], list[str]]:
    """Where each pass goes on the x axis and its tick label; an infinite rate sits at twice the largest finite."""
    finite = [v for v in values if not math.isinf(v)]
    inf_at = 2 * max(finite) if finite else 1.0
    return ([inf_at if math.isinf(v) else v for v in values],
            ["inf" if math.isinf(v) else f"{v:g}" for v in values])


def plot(path: str, passes: Sequence[Pass], sweep_key: str, title: str) -> None:
    """Output tok/s, TTFT and TPOT (median and p99) against the swept value, one panel each."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    xs, ticks = _x_positions([float(p["level"][sweep_key]) for p in passes])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = [("output tok/s", [("output tok/s", "output_tok_s")]),
              ("TTFT (ms)", [("median", "ttft_median_ms"), ("p99", "ttft_p99_ms")]),
              ("TPOT (ms)", [("median", "tpot_median_ms"), ("p99", "tpot_p99_ms")])]
    for ax, (ylabel, series) in zip(axes, panels):
        for name, key in series:
            ys = [p["metrics"][key] for p in passes]
            ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o", label=name)
        if min(xs) > 0 and max(xs) / min(xs) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, ticks)
        ax.minorticks_off()
        ax.set_xlabel(sweep_key.replace("_", " "))
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

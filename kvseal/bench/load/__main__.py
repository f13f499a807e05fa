"""`kvseal bench` (also `python -m kvseal.bench.load`): load an OpenAI-compatible server (kvseal, vLLM, SGLang,
llama.cpp server) with streamed requests and report throughput, TTFT, TPOT, ITL, E2E latency and goodput.

Exit codes: 0 every request completed, 1 some failed, 2 the benchmark could not run (bad flags, dataset,
server unreachable, no model, or the warm-up request failed). Imports only argparse at import time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import time
from datetime import UTC, datetime
from typing import Any

from kvseal.bench.load.config import BenchConfig, config_from_args


def _fail(message: str) -> int:
    print(f"kvseal bench: {message}", file=sys.stderr)
    return 2


async def _bench(cfg: BenchConfig) -> int:
    from kvseal.audit.runner import AuditSetupError, discover, make_client
    from kvseal.bench.load import dataset, report
    from kvseal.bench.load.client import request_body, run_pass, send_one
    from kvseal.bench.load.metrics import RequestResult, error_counts, request_record, summarize

    for name in ("httpx", "httpcore"):  # `kvseal` logs at INFO; a line per request would drown the bar
        logging.getLogger(name).setLevel(logging.WARNING)
    warm_idx, pass_idx = dataset.slices([lv.num_prompts for lv in cfg.levels], cfg.warmup, cfg.fresh_prompts)
    try:
        prompts = dataset.build(cfg, max([*warm_idx, *(r.stop - 1 for r in pass_idx)]) + 1)
    except (OSError, ValueError) as exc:
        return _fail(f"cannot build the dataset: {exc}")
    # every request of the largest uncapped pass may be in flight at once: the pool must not queue them
    conns = max(lv.max_concurrency or lv.num_prompts for lv in cfg.levels)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    passes: list[dict[str, Any]] = []
    async with make_client(cfg.base_url, cfg.timeout_s, conns, cfg.api_key) as client:
        try:
            model, _, _ = await discover(client, cfg.model, min(cfg.timeout_s, 30.0))
        except AuditSetupError as exc:
            return _fail(str(exc))
        print(f"kvseal bench: {model} at {cfg.base_url}/v1/{cfg.endpoint}, {cfg.dataset} dataset, "
              f"{len(cfg.levels)} pass(es)", file=sys.stderr)
        for i in warm_idx:
            src = prompts[i]
            p = dataclasses.replace(src, output_len=min(src.output_len, 16))
            path, body = request_body(cfg.endpoint, model, p)
            res = await send_one(client, path, body, RequestResult(-1, p.input_len, p.output_len),
                                 cfg.endpoint == "chat")
            if res.error is not None:
                return _fail(f"the warm-up request failed, so the endpoint cannot be benchmarked: {res.error}")
        for n, (level, idx) in enumerate(zip(cfg.levels, pass_idx, strict=True), 1):
            label = report.level_label(dataclasses.asdict(level), cfg.sweep_key)
            results, t0, duration = await run_pass(client, cfg.endpoint, model, level, prompts[idx.start:idx.stop],
                                                   cfg.seed, cfg.progress, f"pass {n}/{len(cfg.levels)} {label}")
            one: dict[str, Any] = {"level": dataclasses.asdict(level),
                                   "metrics": summarize(results, duration, cfg.goodput),
                                   "errors": error_counts(results)}
            if cfg.save_requests:
                one["requests"] = [request_record(r, t0) for r in results]
            passes.append(one)
            m = one["metrics"]
            print(f"kvseal bench: {label}: {m['completed']} completed, {m['failed']} failed, "
                  f"{m['output_tok_s']:.1f} output tok/s", file=sys.stderr)
            for message, count in list(one["errors"].items())[:5]:
                print(f"  {count}x {message}", file=sys.stderr)
    _publish(cfg, model, started, passes)
    return 1 if any(p["metrics"]["failed"] for p in passes) else 0


def _publish(cfg: BenchConfig, model: str, started: str, passes: list[dict[str, Any]]) -> None:
    """The passes as a table on stdout, and as JSON and a plot where asked."""
    from kvseal.bench.load import report
    from kvseal.bench.load.stats import host_info

    print(report.render_table(passes, cfg.sweep_key, bool(cfg.goodput)))
    if cfg.result_json:
        report.write_json(cfg.result_json, {
            "tool": "kvseal bench", "started": started, "target": cfg.base_url, "model": model,
            "config": {**dataclasses.asdict(cfg), "api_key": "<set>" if cfg.api_key else None},  # no secrets on disk
            "machine": host_info(), "sweep_key": cfg.sweep_key,
            "passes": passes})
        print(f"results: {cfg.result_json}")
    if cfg.plot:
        title = f"{model}: {cfg.endpoint}, {cfg.dataset} in={cfg.input_len} out={cfg.output_len}"
        try:
            report.plot(cfg.plot, passes, cfg.sweep_key, title)
            print(f"plot: {cfg.plot}")
        except ImportError:
            print("kvseal bench: --plot needs matplotlib (pip install 'kvseal[bench]')", file=sys.stderr)


def run_bench(a: argparse.Namespace) -> int:
    from kvseal.audit.__main__ import base_url

    try:
        cfg = config_from_args(a, base_url(a.base_url))
    except ValueError as exc:
        return _fail(str(exc))
    t0 = time.monotonic()
    try:
        rc = asyncio.run(_bench(cfg))
    except KeyboardInterrupt:
        return _fail("interrupted")
    print(f"kvseal bench: done in {time.monotonic() - t0:.1f}s, exit {rc}", file=sys.stderr)
    return rc


def main(argv: list[str] | None = None) -> int:
    """`python -m kvseal.bench.load ARGS` is `kvseal bench ARGS` (the same flags, add_bench_args)."""
    from kvseal.bench.load.config import add_bench_args

    p = argparse.ArgumentParser(prog="python -m kvseal.bench.load", description="kvseal bench: load generator and "
                                "latency/throughput report for any OpenAI-compatible server",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_bench_args(p)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""What a client can still see of speculative decoding (issue 33): the timing of the stream's events.

    python -m benchmarks.spec_timing --model ~/.cache/kvseal/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

kvseal sends one token per event however many a step accepted, so event sizes tell nothing. The events of one step
leave together, though: a step that accepted k drafts gives a burst of k + 1 events, where decoding without drafts
spaces events a step apart. This starts `kvseal serve --unified` with --speculative off and lookup, streams the same
edit prompts (benchmarks.spec_edit's) to each, records every event's arrival, and reports the gaps: the share
under --burst-ms, and how many tokens a client counting bursts would infer were accepted against what the server's
/metrics says it accepted.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import cpu_record
from benchmarks.common import ManagedServer, free_port, median
from benchmarks.spec_edit import MODEL, edit_prompts, kvseal_acceptance


def gaps(url: str, model: str, prompt: str, max_tokens: int) -> list[float]:
    """Seconds between consecutive events that carried text."""
    times: list[float] = []
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if any(c.get("text") for c in chunk.get("choices") or []):
                    times.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(times)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--edits", type=int, default=3)
    p.add_argument("--burst-ms", type=float, default=1.0, help="a gap shorter than this: the same step")
    p.add_argument("--out", default="bench_out/spec_timing.json")
    a = p.parse_args(argv)
    prompts = edit_prompts(a.edits)
    res: dict[str, Any] = {"cpu": cpu_record.collect(), "model": a.model, "burst_ms": a.burst_ms}
    for spec in ("off", "lookup"):
        port = free_port()
        srv = ManagedServer([sys.executable, "-m", "kvseal", "serve", "--unified", a.model, "--port", str(port),
                             "--speculative", spec, "--log-level", "warning"], f"http://127.0.0.1:{port}", "/health",
                            f"/tmp/kvseal-spec-timing-{spec}.log")
        try:
            srv.wait_ready(900)
            model = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]
            all_gaps: list[float] = []
            for _, prompt, max_tokens in prompts:
                all_gaps += gaps(srv.url, model, prompt, max_tokens)
            m = kvseal_acceptance(srv.url)
        finally:
            srv.stop()
        bursts = sum(1 for g in all_gaps if g * 1000 < a.burst_ms)  # events that followed their step's first
        res[spec] = {"events": len(all_gaps) + a.edits, "gaps_under_burst": bursts,
                     "share_under_burst": bursts / len(all_gaps) if all_gaps else 0.0,
                     "median_gap_ms": median(all_gaps) * 1000 if all_gaps else None,
                     "inferred_accepted": bursts, "accepted": m.get("spec_decode_num_accepted_tokens_total", 0.0)}
        r = res[spec]
        print(f"{spec:7s} events {r['events']:5d}  gaps under {a.burst_ms:g} ms: {r['share_under_burst']:.1%}  "
              f"median gap {r['median_gap_ms']:.1f} ms  accepted: inferred from bursts {bursts}, "
              f"by the server {int(r['accepted'])}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(cpu_record.header(res["cpu"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

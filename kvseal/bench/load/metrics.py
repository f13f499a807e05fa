"""Per-request timings and the summary of a pass. Pure: results in, numbers out (no clock, no I/O).

Definitions (those of vLLM's and SGLang's serving benchmarks):
- TTFT: first chunk that carries output - request sent;
- TPOT: (last such chunk - first) / (output tokens - 1), undefined for a single token;
- ITL: every gap between consecutive chunks that carry output (a chunk may hold more than one token);
- E2E: end of the stream - request sent;
- throughputs: tokens of the completed requests / the pass's wall time (first send to last answer);
- goodput: completed requests that met every --goodput limit, per second of the pass.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvseal.bench.load.stats import percentile, request_latency

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestResult:
    index: int
    input_len: int | None  # as the dataset built it (None when unknown)
    output_len: int  # as asked for
    t_send: float = 0.0  # monotonic; when the request left (after any client-side concurrency wait)
    t_end: float = 0.0  # monotonic; when the answer ended (or failed)
    arrivals: list[float] = field(default_factory=list)  # monotonic times of chunks that carried output
    usage_prompt: int | None = None
    usage_completion: int | None = None
    usage_cached: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server reports it
    error: str | None = None  # None: completed

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        """The server's count (usage) when it gave one, else one per chunk that carried output."""
        return self.usage_completion if self.usage_completion is not None else len(self.arrivals)

    @property
    def input_tokens(self) -> int:
        if self.usage_prompt is not None:
            return self.usage_prompt
        return self.input_len or 0

    @property
    def short(self) -> bool:
        """Completed with fewer tokens than asked: with ignore_eos a sign the server ignored it (not a failure)."""
        return self.ok and self.output_tokens < self.output_len

    def ttft_tpot(self) -> tuple[float, float]:
        return request_latency(self.t_send, [(t, 1) for t in self.arrivals], self.output_tokens)

    def itl(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.arrivals)]

    def e2e(self) -> float:
        return self.t_end - self.t_send


def meets(r: RequestResult, limits: Sequence[tuple[str, float]]) -> bool:
    """Completed within every (metric, seconds) limit. A single-token answer has no TPOT and passes a TPOT
    limit (vLLM counts its TPOT as 0); an answer without any output has no TTFT and fails a TTFT limit."""
    if not r.ok:
        return False
    ttft, tpot = r.ttft_tpot()
    values = {"ttft": ttft, "tpot": 0.0 if math.isnan(tpot) else tpot, "e2e": r.e2e()}
    return all(not math.isnan(values[m]) and values[m] <= limit for m, limit in limits)


def _stats(name: str, xs: Sequence[float]) -> dict[str, float]:
    mean = sum(xs) / len(xs) if xs else math.nan
    return {f"{name}_mean_ms": mean * 1e3, f"{name}_median_ms": percentile(xs, 50) * 1e3,
            f"{name}_p99_ms": percentile(xs, 99) * 1e3}


def summarize(results: Sequence[RequestResult], duration_s: float,
              goodput: Sequence[tuple[str, float]] = ()) -> dict[str, float | int | None]:
    """The numbers of one pass. Latencies come from completed requests only; failures are counted, not timed."""
    done = [r for r in results if r.ok]
    lat = [r.ttft_tpot() for r in done]
    samples = {"ttft": [x for x, _ in lat if not math.isnan(x)], "tpot": [y for _, y in lat if not math.isnan(y)],
               "itl": [g for r in done for g in r.itl()], "e2e": [r.e2e() for r in done]}
    tokens_in = sum(r.input_tokens for r in done)
    tokens_out = sum(r.output_tokens for r in done)
    good = sum(meets(r, goodput) for r in done) if goodput else None
    duration_s = duration_s if duration_s > 0 else math.nan  # rates of an instant pass are undefined
    out: dict[str, float | int | None] = {
        "duration_s": duration_s, "num_requests": len(results), "completed": len(done),
        "failed": len(results) - len(done), "short_outputs": sum(r.short for r in done),
        "total_input_tokens": tokens_in, "total_output_tokens": tokens_out,
        "cached_input_tokens": (sum(r.usage_cached or 0 for r in done)
                                if any(r.usage_cached is not None for r in done) else None),
        "request_throughput": len(done) / duration_s, "input_tok_s": tokens_in / duration_s,
        "output_tok_s": tokens_out / duration_s, "total_tok_s": (tokens_in + tokens_out) / duration_s,
        "good_requests": good, "goodput": None if good is None else good / duration_s}
    for name in LATENCY_METRICS:
        out.update(_stats(name, samples[name]))
    return out


def error_counts(results: Sequence[RequestResult]) -> dict[str, int]:
    """How often each error message came back, most common first."""
    return dict(Counter(r.error for r in results if r.error is not None).most_common())


def request_record(r: RequestResult, t0: float) -> dict[str, object]:
    """One request's raw numbers for --save-requests (times in ms; t0 is the pass's start)."""
    ttft, tpot = r.ttft_tpot()
    return {"index": r.index, "input_len": r.input_len, "output_len": r.output_len,
            "prompt_tokens": r.usage_prompt, "cached_tokens": r.usage_cached, "output_tokens": r.output_tokens,
            "error": r.error,
            "sent_ms": (r.t_send - t0) * 1e3, "ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3, "e2e_ms": r.e2e() * 1e3,
            "itl_ms": [g * 1e3 for g in r.itl()]}

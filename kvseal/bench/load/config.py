"""`kvseal bench` settings: the frozen config, its argparse flags, and the pure parsers behind them
(sweep lists, request rates, goodput limits). Every check here raises ValueError with the flag named."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Literal

Endpoint = Literal["completions", "chat"]
DatasetKind = Literal["fixed", "random", "jsonl", "prefix"]

# goodput keys -> the per-request metric they limit; "e2el" is vLLM's spelling of e2e
GOODPUT_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2e", "e2el": "e2e"}


@dataclass(frozen=True)
class Level:
    """One pass of a run: how requests arrive, how many may be in flight, and how many are sent."""

    request_rate: float  # requests per second of a Poisson process; math.inf sends all at once
    max_concurrency: int | None  # None: no client-side cap
    num_prompts: int


@dataclass(frozen=True)
class BenchConfig:
    base_url: str  # scheme://host:port[/prefix], without the trailing /v1
    model: str | None  # None: the first id of GET /v1/models
    endpoint: Endpoint
    dataset: DatasetKind
    dataset_path: str | None  # required for (and only used by) the jsonl dataset
    input_len: int
    output_len: int
    range_ratio: float  # 0 <= r < 1; lengths of the random dataset are uniform in [len*(1-r), len*(1+r)]
    tokenizer: str | None
    seed: int
    levels: tuple[Level, ...]  # the passes, in the order they run
    fresh_prompts: bool  # every pass (and the warm-up) gets prompts no other one sent: no prefix-cache hits
    goodput: tuple[tuple[str, float], ...]  # (metric, limit in seconds); empty: no goodput
    timeout_s: float
    warmup: int
    api_key: str | None
    result_json: str | None
    plot: str | None
    save_requests: bool
    progress: bool
    # the prefix dataset: --num-prefixes shared heads of --prefix-len tokens, each prompt one of them (in turn)
    # followed by --suffix-len tokens of its own
    prefix_len: int = 0
    suffix_len: int = 0
    num_prefixes: int = 0

    @property
    def sweep_key(self) -> str:
        """What the passes vary, for the table and the plot's x axis."""
        if len({lv.request_rate for lv in self.levels}) > 1 or self.levels[0].max_concurrency is None:
            return "request_rate"
        return "max_concurrency"


def parse_rate(text: str) -> float:
    rate = math.inf if text.strip().lower() in ("inf", "infinity") else float(text)
    if not rate > 0:
        raise ValueError(f"--request-rate must be positive or inf, got {text!r}")
    return rate


def parse_list(text: str, flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",")]
    if not items or any(not x for x in items):
        raise ValueError(f"{flag}: expected a comma-separated list, got {text!r}")
    return items


def positive_ints(text: str, flag: str) -> list[int]:
    items = parse_list(text, flag)
    try:
        values = [int(x) for x in items]
    except ValueError as exc:
        raise ValueError(f"{flag}: expected whole numbers, got {text!r}") from exc
    if any(v < 1 for v in values):
        raise ValueError(f"{flag}: every value must be at least 1, got {text!r}")
    return values


def sweep_levels(rates: str, concurrencies: str | None, num_prompts: int,
                 prompts_per_level: str | None) -> tuple[Level, ...]:
    """The passes: one per value of whichever of --request-rate / --max-concurrency is a list (at most one
    may be), each sending --num-prompts prompts, or --prompts-per-level (one count, or one per pass)."""
    rate_list = [parse_rate(r) for r in parse_list(rates, "--request-rate")]
    conc_list: list[int | None] = list(positive_ints(concurrencies, "--max-concurrency")) if concurrencies else [None]
    if len(rate_list) > 1 and len(conc_list) > 1:
        raise ValueError("sweep one of --request-rate and --max-concurrency, not both")
    n = max(len(rate_list), len(conc_list))
    rate_list, conc_list = rate_list * (n // len(rate_list)), conc_list * (n // len(conc_list))
    if num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    counts = positive_ints(prompts_per_level, "--prompts-per-level") if prompts_per_level else [num_prompts]
    if len(counts) == 1:
        counts = counts * n
    if len(counts) != n:
        raise ValueError(f"--prompts-per-level has {len(counts)} values for {n} passes")
    return tuple(Level(r, c, k) for r, c, k in zip(rate_list, conc_list, counts))


def parse_goodput(items: list[str]) -> tuple[tuple[str, float], ...]:
    """['ttft:500', 'tpot:100'] (milliseconds) -> (('ttft', 0.5), ('tpot', 0.1))."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        metric = GOODPUT_KEYS.get(key.strip().lower())
        if not sep or metric is None:
            raise ValueError(f"--goodput: expected METRIC:MS with METRIC one of ttft, tpot, e2e; got {item!r}")
        try:
            ms = float(value)
        except ValueError as exc:
            raise ValueError(f"--goodput: {item!r} has no number of milliseconds") from exc
        if not ms > 0:
            raise ValueError(f"--goodput: the limit in {item!r} must be positive")
        out[metric] = ms / 1e3
    return tuple(out.items())


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--model", default=None, help="model id to send; when not given: the first id of GET /v1/models")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                   help="/v1/completions (prompts of exact token length, sent as token ids) or "
                        "/v1/chat/completions (text prompts of N random words: the token length is approximate)")
    p.add_argument("--api-key", default=None, help="bearer token to send")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", default="fixed", choices=["fixed", "random", "jsonl", "prefix"],
                   help="fixed: every prompt --input-len tokens and --output-len out; random: lengths uniform in "
                        "[len*(1-r), len*(1+r)] for r = --range-ratio; jsonl: --dataset-path; prefix: shared "
                        "heads (--num-prefixes of --prefix-len tokens) with suffixes of --suffix-len tokens")
    d.add_argument("--prefix-len", type=int, default=512, help="prefix: tokens of each shared head")
    d.add_argument("--suffix-len", type=int, default=64, help="prefix: tokens after the head, new in each prompt")
    d.add_argument("--num-prefixes", type=int, default=4,
                   help="prefix: distinct heads; prompt i starts with head i mod N")
    d.add_argument("--dataset-path", default=None, metavar="FILE",
                   help='jsonl: one JSON object a line, {"prompt": "...", "output_len": 128} (output_len optional, '
                        "default --output-len); with fewer lines than prompts needed they are reused in order")
    d.add_argument("--input-len", type=int, default=128, help="prompt tokens (fixed/random)")
    d.add_argument("--output-len", type=int, default=128,
                   help="output tokens asked for (max_tokens = min_tokens, ignore_eos)")
    d.add_argument("--range-ratio", type=float, default=0.0, help="random: spread of the lengths, 0 <= r < 1")
    d.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json (or a folder holding one) of the served model: token ids are then drawn "
                        "from its vocabulary, chat prompts are its decoded text, and jsonl prompts are counted "
                        "(when not given: ids in [1000, 20000), chat prompts of random words)")
    d.add_argument("--seed", type=int, default=0, help="seed for prompts, lengths and arrival times")
    lo = p.add_argument_group("load")
    lo.add_argument("--num-prompts", type=int, default=100, help="requests in each pass")
    lo.add_argument("--request-rate", default="inf",
                    help="requests per second, Poisson arrivals (inf: all at once); a comma list sweeps")
    lo.add_argument("--max-concurrency", default=None,
                    help="most requests in flight (when not given: no cap); a comma list such as 1,4,16,32 runs one "
                         "pass per value, in order")
    lo.add_argument("--prompts-per-level", default=None,
                    help="requests in each pass of a sweep instead of --num-prompts: one count, or one per pass")
    lo.add_argument("--fresh-prompts", action="store_true",
                    help="give every pass and the warm-up prompts of their own (by default each pass resends the "
                         "first prompts of the list, which a server with a prefix cache then answers from it)")
    lo.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                    help="service-level limits in ms (ttft, tpot, e2e), e.g. ttft:500 tpot:100: goodput is the "
                         "requests per second that met all of them")
    lo.add_argument("--timeout", type=float, default=600.0,
                    help="seconds without progress (connect, or between stream chunks) before a request fails")
    lo.add_argument("--warmup", type=int, default=1,
                    help="requests sent one by one before the first pass, not measured; when one fails the run "
                         "stops with exit 2")
    o = p.add_argument_group("output")
    o.add_argument("--result-json", default=None, metavar="PATH",
                   help="write the config, machine facts and every pass here")
    o.add_argument("--save-requests", action="store_true", help="put each request's raw numbers in --result-json")
    o.add_argument("--plot", default=None, metavar="PATH.png",
                   help="plot output tok/s, TTFT and TPOT (median, p99) against the swept value (needs matplotlib)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def config_from_args(a: argparse.Namespace, base_url: str) -> BenchConfig:
    if a.input_len < 1 or a.output_len < 1:
        raise ValueError("--input-len and --output-len must be at least 1")
    if not 0.0 <= a.range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {a.range_ratio}")
    if a.dataset == "jsonl" and not a.dataset_path:
        raise ValueError("--dataset jsonl needs --dataset-path")
    if a.dataset == "prefix" and min(a.prefix_len, a.suffix_len, a.num_prefixes) < 1:
        raise ValueError("--prefix-len, --suffix-len and --num-prefixes must be at least 1")
    if a.timeout <= 0 or a.warmup < 0:
        raise ValueError("--timeout must be positive and --warmup not negative")
    for flag, path in (("--result-json", a.result_json), ("--plot", a.plot)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):  # fail before the run, not after
            raise ValueError(f"{flag}: the folder of {path!r} does not exist")
    return BenchConfig(
        base_url=base_url, model=a.model, endpoint=a.endpoint, dataset=a.dataset, dataset_path=a.dataset_path,
        input_len=a.input_len, output_len=a.output_len, range_ratio=a.range_ratio, tokenizer=a.tokenizer,
        seed=a.seed, levels=sweep_levels(a.request_rate, a.max_concurrency, a.num_prompts, a.prompts_per_level),
        fresh_prompts=a.fresh_prompts,
        goodput=parse_goodput(a.goodput), timeout_s=a.timeout, warmup=a.warmup, api_key=a.api_key,
        result_json=a.result_json, plot=a.plot, save_requests=a.save_requests, progress=not a.no_progress,
        prefix_len=a.prefix_len, suffix_len=a.suffix_len, num_prefixes=a.num_prefixes)

"""Speculative decoding on code edits (issue 33): kvseal with --speculative off and lookup against llama-server
without speculation and with each of its n-gram --spec-type settings, on the same machine, in one run, with the
same prompts.

    python -m benchmarks.spec_edit                                   # 1.5B, three rounds, both workloads
    python -m benchmarks.spec_edit --rounds "" --streams 32          # kvseal off against lookup only, and 32 streams

Workloads (greedy, temperature 0, each request streamed, the Qwen chat template written as text to /v1/completions
so that every server tokenizes the same string):
  edit    functions taken from Python's own standard library (inspect.getsource), each with an instruction to
          rename one of its local variables and return the whole function
  random  the side by side's: 128 random token ids, 128 output tokens with ignore_eos
A round starts its systems together (kvseal off, kvseal lookup, llama-server none and the round's --spec-types) and
sends each prompt to each of them in turn, one request at a time, the order rotating: whatever else loads the
machine falls on all of them alike. The figure per request is its decode rate, (completion tokens - 1) / (last
chunk - first chunk); the table gives the median over requests and the acceptance rate (kvseal: its /metrics;
llama-server: the final chunk's timings). kvseal's token ids (return_token_ids) are compared off against lookup.
With --streams N, kvseal off and lookup also serve N concurrent edits, whole runs alternated.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import inspect
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import cpu_record
from benchmarks.common import ManagedServer, free_port, median
from benchmarks.systems import default_peers_dir

MODEL = str(Path.home() / ".cache/kvseal/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
# functions of Python's standard library, 15 to 60 lines each (the same on every machine with Python 3.11)
SOURCES = ("textwrap.TextWrapper._wrap_chunks", "textwrap.dedent", "shlex.split", "difflib.SequenceMatcher.ratio",
           "difflib.SequenceMatcher.get_opcodes", "json.decoder.JSONObject", "calendar.Calendar.itermonthdays2",
           "string.capwords", "fnmatch.translate", "posixpath.normpath", "heapq.merge", "base64.b32decode")


def chat(user: str) -> str:
    return f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n" \
           "<|im_start|>assistant\n"


def _resolve(dotted: str) -> Any:
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def edit_prompts(n: int) -> list[tuple[str, str, int]]:
    """(name, prompt, max_tokens): rename a local variable of a stdlib function and return the whole function."""
    out = []
    for dotted in SOURCES[:n]:
        src = inspect.cleandoc("\n" + inspect.getsource(_resolve(dotted)))
        names = [t.id for t in ast.walk(ast.parse(src)) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)]
        old = max(set(names), key=names.count) if names else "self"
        user = (f"Rename the variable `{old}` to `{old}_renamed` in this Python function. Return the whole function "
                f"and nothing else.\n\n```python\n{src}\n```")
        out.append((dotted, chat(user), 64 + len(src) // 2))
    return out


def random_prompts(n: int, seed: int = 0) -> list[tuple[str, Any, int]]:
    """The side by side's workload (kvseal bench --dataset fixed): 128 random token ids, 128 tokens out."""
    rng = random.Random(seed)
    return [(f"random{i}", [rng.randrange(1000, 150000) for _ in range(128)], 128) for i in range(n)]


def launch(system: str, port: int, threads: int, arithmetic: str) -> tuple[list[str], dict[str, str]]:
    if system.startswith("kvseal"):
        return ([sys.executable, "-m", "kvseal", "serve", "--unified", MODEL_PATH[0], "--port", str(port),
                 "--speculative", system.removeprefix("kvseal-"), "--arithmetic", arithmetic,
                 "--log-level", "warning"], {})
    spec = system.removeprefix("llama-")
    llama = Path(default_peers_dir()) / "bin" / "llama-server"
    argv = [str(llama), "-m", MODEL_PATH[0], "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", "1", "-c", "8192", "--no-cache-prompt"]  # one stream: one slot
    if spec != "none":
        argv += ["--spec-type", spec]
    return argv, {}


MODEL_PATH = [MODEL]


async def one(client: httpx.AsyncClient, url: str, prompt: Any, max_tokens: int, ignore_eos: bool,
              model: str) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    if ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    first = last = None
    tokens: list[int] = []
    n = 0
    timings: dict[str, Any] = {}
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            for c in chunk.get("choices") or []:
                if c.get("text") or c.get("token_ids"):
                    first = first if first is not None else now
                    last = now
                    tokens += c.get("token_ids") or []
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            timings = chunk.get("timings") or timings
    n = n or timings.get("predicted_n", 0)
    rate = (n - 1) / (last - first) if first is not None and last is not None and last > first and n > 1 else None
    return {"tokens": n, "ids": tokens, "ttft": None if first is None else first - t0, "rate": rate,
            "seconds": time.perf_counter() - t0, "draft_n": timings.get("draft_n"),
            "draft_accepted": timings.get("draft_n_accepted")}


async def workload(url: str, model: str, prompts: list[tuple[str, Any, int]], streams: int,
                   ignore_eos: bool) -> dict[str, Any]:
    sem = asyncio.Semaphore(streams)
    async with httpx.AsyncClient() as client:
        async def run(p: tuple[str, Any, int]) -> dict[str, Any]:
            async with sem:
                return {"name": p[0], **await one(client, url, p[1], p[2], ignore_eos, model)}

        t0 = time.perf_counter()
        reqs = await asyncio.gather(*(run(p) for p in prompts))
        wall = time.perf_counter() - t0
    rates = [r["rate"] for r in reqs if r["rate"]]
    return {"requests": reqs, "wall_s": wall, "tok_s": sum(r["tokens"] for r in reqs) / wall,
            "median_rate": median(rates) if rates else None}


def kvseal_acceptance(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    got = {}
    for line in text.splitlines():
        for key in ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total"):
            if line.startswith("kvseal:" + key + " "):
                got[key] = float(line.split()[-1])
    return got


def start(system: str, a: argparse.Namespace, out_dir: Path, arithmetic: str) -> ManagedServer:
    port = free_port()
    argv, env = launch(system, port, a.threads, arithmetic)
    return ManagedServer(argv, f"http://127.0.0.1:{port}", "/health", str(out_dir / f"{system}-{arithmetic}.log"), env)


def acceptance(system: str, url: str, reqs: list[dict[str, Any]], before: dict[str, float]) -> dict[str, Any]:
    if system.startswith("kvseal"):
        after = kvseal_acceptance(url)
        drafted = after["spec_decode_num_draft_tokens_total"] - before.get("spec_decode_num_draft_tokens_total", 0)
        accepted = after["spec_decode_num_accepted_tokens_total"] - before.get(
            "spec_decode_num_accepted_tokens_total", 0)
    else:
        drafted = sum(x["draft_n"] or 0 for x in reqs)
        accepted = sum(x["draft_accepted"] or 0 for x in reqs)
    return {"drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None}


def one_round(systems: list[str], a: argparse.Namespace, work: dict[str, list[tuple[str, Any, int]]],
              out_dir: Path, arithmetic: str) -> dict[str, Any]:
    """Every system of the round up at once; each prompt goes to each system in turn (the order rotating), one
    request at a time, so that the machine's other load falls on all of them alike."""
    servers = {s: start(s, a, out_dir, arithmetic) for s in systems}
    res: dict[str, Any] = {s: {"argv": servers[s].argv} for s in systems}
    try:
        for s, srv in servers.items():
            res[s]["ready_s"] = srv.wait_ready(900)
        models = {s: httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]
                  for s, srv in servers.items()}
        for name, prompts in work.items():
            before = {s: kvseal_acceptance(srv.url) if s.startswith("kvseal") else {} for s, srv in servers.items()}
            reqs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
            for i, p in enumerate(prompts):
                for s in systems[i % len(systems):] + systems[:i % len(systems)]:
                    r = asyncio.run(workload(servers[s].url, models[s], [p], 1, name == "random"))
                    reqs[s] += r["requests"]
            for s in systems:
                rates = [r["rate"] for r in reqs[s] if r["rate"]]
                res[s][name] = {"requests": reqs[s], "median_rate": median(rates) if rates else None,
                                **acceptance(s, servers[s].url, reqs[s], before[s])}
                row = res[s][name]
                acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
                print(f"{s:22s} {arithmetic:5s} {name:6s} median {row['median_rate'] or 0:7.1f} tok/s  "
                      f"acceptance {acc} ({int(row['drafted'])} drafted)", flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    return res


def many_streams(a: argparse.Namespace, prompts: list[tuple[str, Any, int]], out_dir: Path, arithmetic: str,
                 streams: int, repeats: int) -> dict[str, Any]:
    """kvseal off and lookup, both up; whole runs of `streams` concurrent edits alternated."""
    systems = ["kvseal-off", "kvseal-lookup"]
    servers = {s: start(s, a, out_dir, arithmetic) for s in systems}
    res: dict[str, Any] = {s: {"runs": []} for s in systems}
    try:
        for srv in servers.values():
            srv.wait_ready(900)
        for k in range(repeats):
            for s in systems if k % 2 == 0 else systems[::-1]:
                url = servers[s].url
                model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
                before = kvseal_acceptance(url)
                r = asyncio.run(workload(url, model, prompts, streams, False))
                r |= acceptance(s, url, r["requests"], before)
                res[s]["runs"].append(r)
                print(f"{s:22s} {arithmetic:5s} edit x{streams}  total {r['tok_s']:7.1f} tok/s  drafted "
                      f"{int(r['drafted'])}", flush=True)
        for s in systems:
            res[s]["median_tok_s"] = median([r["tok_s"] for r in res[s]["runs"]])
    finally:
        for srv in servers.values():
            srv.stop()
    return res


def identical(rounds: list[dict[str, Any]]) -> dict[str, bool]:
    """kvseal off against lookup, prompt for prompt, in every round and workload."""
    same: dict[str, bool] = {}
    for i, r in enumerate(rounds):
        off, on = r["systems"].get("kvseal-off"), r["systems"].get("kvseal-lookup")
        if off and on:
            for name in [k for k in off if isinstance(off[k], dict) and "requests" in off[k]]:
                same[f"{r['arithmetic']}:{i}:{name}"] = all(
                    x["ids"] == y["ids"] for x, y in zip(off[name]["requests"], on[name]["requests"], strict=True))
    return same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--rounds", default="ngram-simple,ngram-map-k;ngram-map-k4v,ngram-mod;ngram-cache",
                   help="llama-server --spec-type settings, a round each (';' between rounds); every round also runs "
                   "kvseal off, kvseal lookup and llama-server without speculation")
    p.add_argument("--workloads", default="edit,random")
    p.add_argument("--edits", type=int, default=4, help=f"edit prompts (stdlib functions), at most {len(SOURCES)}")
    p.add_argument("--randoms", type=int, default=2)
    p.add_argument("--streams", type=int, default=0, help="also N concurrent edits, kvseal off against lookup")
    p.add_argument("--repeats", type=int, default=2, help="alternated runs of each for --streams")
    p.add_argument("--arithmetic", default="auto", help="kvseal's: auto, exact, fast; comma-separated to run each")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default="bench_out/spec_edit.json")
    a = p.parse_args(argv)
    MODEL_PATH[0] = a.model
    work = {}
    if "edit" in a.workloads:
        work["edit"] = edit_prompts(a.edits)
    if "random" in a.workloads:
        work["random"] = random_prompts(a.randoms)
    out_dir = Path(tempfile.mkdtemp(prefix="kvseal-spec-"))
    rec = cpu_record.collect()
    rounds = []
    for arith in a.arithmetic.split(","):
        for spec in [r for r in a.rounds.split(";") if r] or [""]:
            llamas = [f"llama-{t}" for t in spec.split(",") if t]
            systems = ["kvseal-off", "kvseal-lookup", *(["llama-none", *llamas] if llamas else [])]
            rounds.append({"arithmetic": arith, "systems": one_round(systems, a, work, out_dir, arith)})
    streams = {}
    if a.streams:
        edits = edit_prompts(a.edits)
        streams = many_streams(a, edits * max(1, a.streams // len(edits)), out_dir, a.arithmetic.split(",")[0],
                               a.streams, a.repeats)
    same = identical(rounds)
    print("identical greedy tokens, kvseal off vs lookup:", same)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True,
                            text=True).stdout.strip()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"cpu": rec, "model": a.model, "rounds": rounds, "streams": streams,
                                       "identical": same, "commit": commit}, indent=1))
    print(cpu_record.header(rec))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Speculative decoding on code edits (issue 33): kvseal with --speculative off and lookup against llama-server with
each of its --spec-type settings, one after another on the same machine, in one run, with the same prompts.

    python -m benchmarks.spec_edit                                   # 1.5B, every system, both workloads
    python -m benchmarks.spec_edit --systems kvseal-off,kvseal-lookup --edits 4 --streams 1,32

Workloads (greedy, temperature 0, each request streamed, the Qwen chat template written as text to /v1/completions
so that every server tokenizes the same string):
  edit    functions taken from Python's own standard library (inspect.getsource), each with an instruction to
          rename one of its local variables and return the whole function
  random  the side by side's: 128 random token ids, 128 output tokens with ignore_eos (little repeats)
Each (system, workload) is run at every --streams concurrency. The figure per request is its decode rate:
(completion tokens - 1) / (last chunk - first chunk); the table gives the median over requests, the total output
tokens a second over the run, and the acceptance rate (kvseal: /metrics; llama-server: the final chunk's timings).
kvseal's token ids (return_token_ids) are compared off against lookup, prompt for prompt.
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
SYSTEMS = ("kvseal-off", "kvseal-lookup", "llama-none", *(f"llama-{t}" for t in SPEC_TYPES))
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
            "-tb", str(threads), "-np", "32", "-c", str(32 * 2048), "-cb", "--no-cache-prompt"]
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


def run_system(system: str, a: argparse.Namespace, work: dict[str, list[tuple[str, Any, int]]],
               out_dir: Path, arithmetic: str) -> dict[str, Any]:
    port = free_port()
    argv, env = launch(system, port, a.threads, arithmetic)
    log = out_dir / f"{system}-{arithmetic}.log"
    server = ManagedServer(argv, f"http://127.0.0.1:{port}", "/health", str(log), env)
    res: dict[str, Any] = {"system": system, "arithmetic": arithmetic, "argv": argv}
    try:
        res["ready_s"] = server.wait_ready(900)
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for name, prompts in work.items():
            for streams in a.streams:
                before = kvseal_acceptance(server.url) if system.startswith("kvseal") else {}
                r = asyncio.run(workload(server.url, model, prompts, streams, name == "random"))
                after = kvseal_acceptance(server.url) if system.startswith("kvseal") else {}
                if after:
                    drafted = after["spec_decode_num_draft_tokens_total"] - before.get(
                        "spec_decode_num_draft_tokens_total", 0)
                    accepted = after["spec_decode_num_accepted_tokens_total"] - before.get(
                        "spec_decode_num_accepted_tokens_total", 0)
                else:
                    drafted = sum(x["draft_n"] or 0 for x in r["requests"])
                    accepted = sum(x["draft_accepted"] or 0 for x in r["requests"])
                r |= {"drafted": drafted, "accepted": accepted,
                      "acceptance": accepted / drafted if drafted else None}
                res[f"{name}@{streams}"] = r
                acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
                print(f"{system:22s} {arithmetic:5s} {name:6s} x{streams:<3d} median {r['median_rate'] or 0:7.1f} "
                      f"tok/s/stream  total {r['tok_s']:7.1f} tok/s  acceptance {acc} ({int(drafted)} drafted)",
                      flush=True)
    except (OSError, RuntimeError, TimeoutError, httpx.HTTPError, KeyError, ValueError) as exc:  # a row says why
        res["error"] = repr(exc)[:2000]
        print(f"{system}: {res['error'][:300]}", flush=True)
    finally:
        server.stop()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--workloads", default="edit,random")
    p.add_argument("--edits", type=int, default=8, help=f"edit prompts (stdlib functions), at most {len(SOURCES)}")
    p.add_argument("--randoms", type=int, default=4)
    p.add_argument("--streams", default="1", help="concurrencies, comma-separated (e.g. 1,32)")
    p.add_argument("--arithmetic", default="auto", help="kvseal's: auto, exact, fast; comma-separated to run each")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default="bench_out/spec_edit.json")
    a = p.parse_args(argv)
    a.streams = [int(s) for s in a.streams.split(",")]
    MODEL_PATH[0] = a.model
    work = {}
    if "edit" in a.workloads:
        work["edit"] = edit_prompts(a.edits)
    if "random" in a.workloads:
        work["random"] = random_prompts(a.randoms)
    if 32 in a.streams and "edit" in work:  # 32 streams: every edit prompt four times over
        work["edit"] = work["edit"] * max(1, 32 // len(work["edit"]))
    out_dir = Path(tempfile.mkdtemp(prefix="kvseal-spec-"))
    rec = cpu_record.collect()
    results = []
    for system in a.systems.split(","):
        for arith in (a.arithmetic.split(",") if system.startswith("kvseal") else ["-"]):
            results.append(run_system(system, a, work, out_dir, arith))
    same = {}
    by = {(r["system"], r["arithmetic"]): r for r in results}
    for arith in a.arithmetic.split(","):
        off, on = by.get(("kvseal-off", arith)), by.get(("kvseal-lookup", arith))
        if off and on:
            for key in [k for k in off if "@" in k and k in on]:
                same[f"{arith}:{key}"] = all(x["ids"] == y["ids"] for x, y in zip(off[key]["requests"],
                                                                                  on[key]["requests"]))
    print("identical greedy tokens, kvseal off vs lookup:", same)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True,
                            text=True).stdout.strip()
    Path(a.out).write_text(json.dumps({"cpu": rec, "model": a.model, "results": results, "identical": same,
                                       "commit": commit}, indent=1))
    print(cpu_record.header(rec))
    return 0 if all("error" not in r for r in results) and all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

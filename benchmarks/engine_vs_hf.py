"""kvseal against Hugging Face transformers `generate` on the same machine, in one run.

    python -m benchmarks.engine_vs_hf                       # 1/8/32 concurrent, both dtypes, 3 repeats
    python -m benchmarks.engine_vs_hf --quick               # a smoke run with small sizes

Workload: N concurrent requests of --prompt-len random token ids, --new-tokens greedy tokens each with EOS
ignored (every request yields exactly that many), for N in --concurrency; and one --prefill-len prompt with
max_tokens=1 (prefill tok/s = prompt tokens / TTFT). Systems, all on the same weights and dtype:
  hf      transformers LlamaForCausalLM.generate, batch = N, left padded, min_new_tokens = max_new_tokens
  engine  kvseal's Engine in this process: add_request x N, then step() until done; a timestamp per delta
  http    `kvseal serve --unified` subprocess; N streamed /v1/completions (token-id prompts, ignore_eos)
  disagg  `kvseal serve` (router + prefill + decode processes), same requests
TTFT = first token (delta / SSE chunk) - submit; TPOT = (last - first) / (tokens - 1) per request. All systems
are loaded at once and measured interleaved (repeat -> workload -> system). Every figure is the median over
--repeats runs; ratios are against transformers in the same command. JSON (raw runs too) goes to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    ServerProc,
    fmt_ms,
    fmt_ratio,
    hf_model,
    left_pad,
    machine_info,
    make_prompts,
    markdown_table,
    median_of_runs,
    run_stats,
    stream_completion,
)

Requests = list[tuple[float, list[tuple[float, int]], int]]
RunFn = Callable[[list[list[int]], int], Requests]
SYSTEMS = {"hf": "transformers", "engine": "kvseal engine", "http": "kvseal HTTP unified",
           "disagg": "kvseal HTTP disagg"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine_vs_hf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrent request counts")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    p.add_argument("--skip-http", action="store_true", help="do not start servers (in-process engine only)")
    p.add_argument("--skip-disagg", action="store_true", help="HTTP unified only, not router+prefill+decode")
    p.add_argument("--wait-timeout", type=float, default=3600.0,
                   help="kvseal's admission timeout (its default, 60 s, rejects queued requests on a slow CPU)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads here and in each server process (default: torch's / kvseal serve's choice)")
    p.add_argument("--quick", action="store_true", help="smoke run: c=1,4, 32+16 tokens, prefill 256, 1 repeat")
    p.add_argument("--out", default="bench_out/engine_vs_hf.json")
    if "--quick" in (sys.argv[1:] if argv is None else argv):  # smaller defaults; explicit flags still win
        p.set_defaults(concurrency="1,4", prompt_len=32, new_tokens=16, prefill_len=256, repeats=1)
    a = p.parse_args(argv)
    a.concs = [int(x) for x in a.concurrency.split(",")]
    a.dtype_list = [d.strip() for d in a.dtypes.split(",")]
    return a


# -- transformers ----------------------------------------------------------------------------------------


def hf_run_fn(model: Any, pad_id: int, outputs: dict[str, list[int]]) -> RunFn:
    def run(prompts: list[list[int]], new_tokens: int) -> Requests:
        ids, mask = left_pad(prompts, pad_id)
        with torch.inference_mode():
            t0 = time.monotonic()
            out = model.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id)
            t1 = time.monotonic()
        if out.shape[1] - len(ids[0]) != new_tokens:
            raise RuntimeError(f"transformers generated {out.shape[1] - len(ids[0])} tokens, not {new_tokens}")
        outputs[f"{len(prompts)}x{new_tokens}"] = out[0, len(ids[0]):].tolist()
        # generate hands back the whole batch at the end: one arrival of every token, no TTFT/TPOT
        return [(t0, [(t1, new_tokens)], new_tokens) for _ in prompts]
    return run


# -- kvseal ----------------------------------------------------------------------------------------------


def engine_run_fn(engine: Any, outputs: dict[str, list[int]]) -> RunFn:
    from kvseal.wire.messages import GenerateRequest, SamplingParams

    counter = [0]

    def run(prompts: list[list[int]], new_tokens: int) -> Requests:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        counter[0] += 1
        rids = [f"b{counter[0]}-{i}" for i in range(len(prompts))]
        arrivals: dict[str, list[tuple[float, int]]] = {r: [] for r in rids}
        ids: dict[str, list[int]] = {r: [] for r in rids}
        t0 = time.monotonic()
        for rid, p in zip(rids, prompts):
            engine.add_request(GenerateRequest(rid, p, params))
        while engine.has_work():
            deltas = engine.step()
            now = time.monotonic()
            for d in deltas:
                if d.token_ids:
                    arrivals[d.request_id].append((now, len(d.token_ids)))
                    ids[d.request_id].extend(d.token_ids)
                if d.final is not None and d.final != "length":
                    raise RuntimeError(f"{d.request_id} ended {d.final}: {d.error}")
        outputs[f"{len(prompts)}x{new_tokens}"] = ids[rids[0]]
        return [(t0, arrivals[r], len(ids[r])) for r in rids]
    return run


def on_thread(pool: ThreadPoolExecutor, run: RunFn) -> RunFn:
    return lambda prompts, new_tokens: pool.submit(run, prompts, new_tokens).result()


def http_run_fn(srv: ServerProc, loop: asyncio.AbstractEventLoop, client: Any) -> RunFn:
    async def many(prompts: list[list[int]], new_tokens: int) -> Requests:
        return list(await asyncio.gather(*(stream_completion(client, srv.url, srv.model, p, new_tokens)
                                           for p in prompts)))
    return lambda prompts, new_tokens: loop.run_until_complete(many(prompts, new_tokens))


# -- every system, every workload, interleaved ------------------------------------------------------------


def measure_all(runs: dict[str, RunFn], a: argparse.Namespace, prompts: list[list[int]], prefill: list[int],
                res: dict[str, Any], save: Callable[[], None]) -> None:
    """repeat -> workload -> system, the system order rotated each repeat: on a shared machine whose load
    drifts, every system of one workload is measured within minutes of the others."""
    names = list(runs)
    for name in names:
        runs[name](prompts[:2], 4)  # warm-up: first-call allocations, thread pools, connections
        res[name] = {"runs": {str(c): [] for c in a.concs}, "prefill_runs": []}
    for r in range(a.repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for c in [*a.concs, 0]:  # 0: the prefill workload
            for name in order:
                reqs = runs[name]([prefill] if c == 0 else prompts[:c], 1 if c == 0 else a.new_tokens)
                if c == 0:
                    ttft = reqs[0][1][0][0] - reqs[0][0]
                    res[name]["prefill_runs"].append({"ttft": ttft, "tok_s": len(prefill) / ttft,
                                                      "load1": os.getloadavg()[0]})
                    rate = len(prefill) / ttft
                else:
                    if any(n != a.new_tokens for _, _, n in reqs):
                        raise RuntimeError(f"{name} c={c}: got {[n for _, _, n in reqs]} tokens, want {a.new_tokens}")
                    res[name]["runs"][str(c)].append({**run_stats(reqs), "load1": os.getloadavg()[0]})
                    rate = res[name]["runs"][str(c)][-1]["tok_s"]
                print(f"  [{r + 1}/{a.repeats}] {SYSTEMS[name]:20s} {c or 'prefill':>7} {rate:8.1f} tok/s  "
                      f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
                res[name]["summary"] = {k: median_of_runs(v) for k, v in res[name]["runs"].items() if v}
                res[name]["prefill"] = median_of_runs(res[name]["prefill_runs"]) if res[name]["prefill_runs"] else {}
                save()


@contextlib.contextmanager
def server(args: list[str]) -> Iterator[RunFn]:
    import httpx

    t = time.monotonic()
    srv = ServerProc(args)
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=httpx.Limits(max_connections=256))
    try:
        srv.ready()
        print(f"  server {' '.join(args)} ready in {time.monotonic() - t:.0f}s", file=sys.stderr, flush=True)
        yield http_run_fn(srv, loop, client)
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
        srv.stop()


# -- report ----------------------------------------------------------------------------------------------


def tables(out: dict[str, Any], concs: list[int], prefill_len: int) -> str:
    thr, lat, agree = [], [], []
    for dtype, res in out["results"].items():
        hf = res.get("hf")
        cols = [s for s in SYSTEMS if s in res]
        for c in concs:
            ref = hf["summary"][str(c)]["tok_s"] if hf else None
            thr.append([dtype, f"decode tok/s, c={c}",
                        *(fmt_ratio(res[s]["summary"][str(c)]["tok_s"], ref) for s in cols)])
        ref = hf["prefill"]["tok_s"] if hf else None
        thr.append([dtype, f"prefill tok/s, {prefill_len} tok",
                    *(fmt_ratio(res[s]["prefill"]["tok_s"], ref) for s in cols)])
        for s in cols:
            if s == "hf":
                continue
            for c in concs:
                m = res[s]["summary"][str(c)]
                tail = c >= 8  # p99 of one sample (c=1) says nothing
                lat.append([dtype, SYSTEMS[s], str(c), fmt_ms(m["ttft_median"]),
                            fmt_ms(m["ttft_p99"]) if tail else "—", fmt_ms(m["tpot_median"]),
                            fmt_ms(m["tpot_p99"]) if tail else "—"])
            lat.append([dtype, SYSTEMS[s], f"prefill {prefill_len}", fmt_ms(res[s]["prefill"]["ttft"]), "—", "—", "—"])
        if res.get("greedy_match") is not None:
            agree.append(f"- {dtype}: the c=1 request's first {res['greedy_match']} greedy tokens are identical "
                         "(engine vs transformers)")
    headers = ["dtype", "workload", *(SYSTEMS[s] for s in SYSTEMS if any(s in r for r in out["results"].values()))]
    return ("Throughput (output tokens/s for decode rows; ratio vs transformers in parentheses)\n\n"
            + markdown_table(headers, thr) + "\n\nLatency (ms; median over repeats of each run's median/p99)\n\n"
            + markdown_table(["dtype", "system", "concurrency", "TTFT median", "TTFT p99", "TPOT median",
                              "TPOT p99"], lat) + ("\n\n" + "\n".join(agree) if agree else ""))


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from kvseal.config import EngineConfig, ModelConfig, SchedulerConfig
    from kvseal.engine.engine import Engine
    from kvseal.model.loader import load_checkpoint

    if a.threads:
        torch.set_num_threads(a.threads)
    ckpt = load_checkpoint(a.model, progress=False)
    prompts = make_prompts(max(a.concs), a.prompt_len, ckpt.arch.vocab_size, seed=0)
    prefill = make_prompts(1, a.prefill_len, ckpt.arch.vocab_size, seed=1)[0]
    pad_id = ckpt.tokenizer.eos_ids[0] if ckpt.tokenizer.eos_ids else 0
    out: dict[str, Any] = {"machine": machine_info(), "command": " ".join(["python -m benchmarks.engine_vs_hf",
                                                                          *(argv or sys.argv[1:])]),
                           "args": {k: v for k, v in vars(a).items()}, "started": time.strftime("%F %T"),
                           "results": {}}
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        path.write_text(json.dumps(out, indent=1))

    for dtype in a.dtype_list:
        res: dict[str, Any] = out["results"].setdefault(dtype, {})
        hf_out: dict[str, list[int]] = {}
        eng_out: dict[str, list[int]] = {}
        print(f"[{dtype}] loading", file=sys.stderr, flush=True)
        with contextlib.ExitStack() as stack:
            runs: dict[str, RunFn] = {}
            # In-process work runs on a worker thread, as the server's engine loop does: under CPU contention
            # libgomp on the main thread can lose a scheduler slice (~12 ms) at every parallel op.
            pool = stack.enter_context(ThreadPoolExecutor(1, "bench"))
            if not a.skip_hf:
                runs["hf"] = on_thread(pool, hf_run_fn(hf_model(ckpt, dtype), pad_id, hf_out))
            engine = Engine(EngineConfig(model=ModelConfig(path=a.model, dtype=dtype),
                                         scheduler=SchedulerConfig(wait_timeout_s=a.wait_timeout)), ckpt)
            runs["engine"] = on_thread(pool, engine_run_fn(engine, eng_out))
            model_arg = ([a.model] if a.model else []) + (["--threads", str(a.threads)] if a.threads else []) \
                + ["--wait-timeout", str(a.wait_timeout)]
            for system, extra in (("http", ["--unified"]), ("disagg", [])):
                if not (a.skip_http or (system == "disagg" and a.skip_disagg)):
                    runs[system] = stack.enter_context(server([*model_arg, "--dtype", dtype, *extra]))
            measure_all(runs, a, prompts, prefill, res, save)
        key = f"1x{a.new_tokens}"  # greedy agreement on the c=1 request (fp32 should agree on every token)
        if key in hf_out and key in eng_out:
            ref, got = hf_out[key], eng_out[key]
            res["greedy_match"] = next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), len(ref))
        del runs, engine
        gc.collect()
        save()
    out["finished"] = time.strftime("%F %T")
    out["tables"] = tables(out, a.concs, a.prefill_len)
    save()
    print(out["tables"])
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

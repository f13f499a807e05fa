"""Tenant fairness under a flood (issue 19): kvseal serve with --fairness vtc against --fairness off, one run.

    python -m benchmarks.fairness                     # scaled to a 2-core machine: a few minutes
    python -m benchmarks.fairness --flood 200 --flood-prompt 1024 --b-seconds 60 --alone-seconds 60 \\
        --max-model-len 2048                          # the issue's full figures (tens of minutes on 2 cores)

Per mode, a fresh `kvseal serve` (disaggregated: router + one prefill + one decode worker) with a tenants file of
two tenants of equal weight:
1. B alone: one streamed chat a second for --alone-seconds (each `max_tokens` --b-tokens, greedy);
2. under the flood: A sends --flood prompts of --flood-prompt random tokens at once (max_tokens --flood-tokens),
   and B keeps sending one chat a second for --b-seconds;
3. both backlogged (unless --no-backlogged): A and B each send --flood such prompts at once.
Reported: B's TTFT p50/p99 and its output tokens/s per request (completion tokens over the request's time from
its first token), alone and under the flood; A's throughput (its prompt + output tokens over the time from the
flood's start to its last answer); B's share of the tokens the router served while both were busy in phase 2 (B
sends one chat a second: its share is bounded by what it asks for, not by the scheduler), and in phase 3 (the
tokens of the answers that came before either tenant got its last one: equal weights, 0.5 is an equal split).
Then the issue's targets: B's TTFT p99 under the flood <= max(2 x alone, alone + 1 s), A's throughput >= 0.9 x
the off figure, B's share while both are busy >= 0.5.

Mode `vllm` (when scripts/setup_baselines.sh vllm installed it): vLLM's CPU build, `--scheduling-policy priority`,
the same model (converted to safetensors), window and workload, with B's requests at priority 0 and A's at 1 (in
vLLM a lower value is served first): what a vLLM user can do for an interactive tenant. vLLM has no tenants, so
B's share in phase 2 is not measured there (phase 3's is counted by the client).

    python -m benchmarks.fairness --modes vtc,off,vllm --vllm-dtype float32
    python -m benchmarks.fairness --modes vllm-chunk256 --vllm-dtype float32   # vLLM with 256-token steps
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import ManagedServer, ServerProc, free_port, make_prompts, markdown_table, median, percentile
from benchmarks.systems import Settings, launch, unavailable

KEYS = {"a": "sk-bench-fair-a", "b": "sk-bench-fair-b", "ops": "sk-bench-fair-ops"}
CHAT = [{"role": "user", "content": "Say hello to the team in one short sentence."}]


def cpu_model() -> str:
    """lscpu's model name (the figure the results are tied to)."""
    try:
        out = subprocess.run(["lscpu"], check=False, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


async def chat(c: httpx.AsyncClient, model: str, max_tokens: int, extra: dict[str, Any]) -> dict[str, float]:
    """One streamed chat: TTFT, time from the first token to the end, completion tokens."""
    body = {"model": model, "messages": CHAT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    t0 = time.monotonic()
    first, n = None, 0
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"B's chat got HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("choices") and first is None:
                first = time.monotonic()
            if obj.get("usage"):
                n = int(obj["usage"]["completion_tokens"])
    end = time.monotonic()
    assert first is not None
    return {"ttft": first - t0, "decode_s": end - first, "tokens": float(n)}


async def every_second(c: httpx.AsyncClient, model: str, seconds: float, max_tokens: int,
                       extra: dict[str, Any]) -> list[dict[str, float]]:
    """B: one chat a second (open loop: a slow answer does not delay the next one)."""
    tasks = []
    t0 = time.monotonic()
    for i in range(int(seconds)):
        await asyncio.sleep(max(0.0, t0 + i - time.monotonic()))
        tasks.append(asyncio.ensure_future(chat(c, model, max_tokens, extra)))
    return list(await asyncio.gather(*tasks))


async def send_all(c: httpx.AsyncClient, model: str, prompts: list[list[int]], max_tokens: int,
                   extra: dict[str, Any]) -> list[tuple[float, int]]:
    """Every prompt at once: (when its answer came, its prompt + output tokens) for each."""

    async def one(p: list[int]) -> tuple[float, int]:
        r = await c.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True, **extra})
        if r.status_code != 200:
            raise RuntimeError(f"a flood request got HTTP {r.status_code}: {r.text[:300]}")
        u = r.json()["usage"]
        return time.monotonic(), int(u["prompt_tokens"]) + int(u["completion_tokens"])

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def flood(c: httpx.AsyncClient, model: str, prompts: list[list[int]], max_tokens: int,
                extra: dict[str, Any]) -> dict[str, float]:
    """A: every prompt at once; its throughput from the first send to the last answer."""
    t0 = time.monotonic()
    done = await send_all(c, model, prompts, max_tokens, extra)
    wall = max(t for t, _ in done) - t0
    out_tokens = len(prompts) * max_tokens
    return {"a_tok_s": sum(n for _, n in done) / wall, "a_out_tok_s": out_tokens / wall, "a_wall_s": wall}


async def both_backlogged(ca: httpx.AsyncClient, cb: httpx.AsyncClient, model: str, a: argparse.Namespace,
                          pa: dict[str, Any], pb: dict[str, Any]) -> float:
    """A and B each send --flood prompts at once: B's share of the tokens answered while both still had work
    (until the first of them got its last answer). Equal weights: 0.5 is an equal split."""
    prompts_a = make_prompts(a.flood, a.flood_prompt, a.vocab, seed=11)
    prompts_b = make_prompts(a.flood, a.flood_prompt, a.vocab, seed=12)
    done_a, done_b = await asyncio.gather(send_all(ca, model, prompts_a, a.flood_tokens, pa),
                                          send_all(cb, model, prompts_b, a.flood_tokens, pb))
    until = min(max(t for t, _ in done_a), max(t for t, _ in done_b))
    got_a = sum(n for t, n in done_a if t <= until)
    got_b = sum(n for t, n in done_b if t <= until)
    return got_b / (got_a + got_b)


def served(url: str) -> dict[str, float]:
    """Tokens the router has served each tenant (prompt tokens at its first token, output as it streams)."""
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEYS['ops']}"}, timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ("kvseal:tenant_prompt_tokens_total", "kvseal:tenant_generation_tokens_total"):
                out[s.labels["tenant"]] = out.get(s.labels["tenant"], 0.0) + s.value
    return out


def b_figures(rows: list[dict[str, float]], tag: str) -> dict[str, float]:
    ttft = [r["ttft"] for r in rows]
    speed = [(r["tokens"] - 1) / r["decode_s"] for r in rows if r["decode_s"] > 0 and r["tokens"] > 1]
    return {f"b_ttft_p50_{tag}": median(ttft), f"b_ttft_p99_{tag}": percentile(ttft, 99),
            f"b_tok_s_{tag}": median(speed), f"b_requests_{tag}": float(len(rows))}


def vllm_server(a: argparse.Namespace, mode: str) -> ManagedServer:
    """vLLM's CPU build on a free port: the bundled model converted, priority scheduling, the same window; mode
    vllm-chunkN: --max-num-batched-tokens N (shorter steps: what a vLLM user tunes for interactive latency)."""
    s = Settings(model_path="", vllm_dtype=a.vllm_dtype, n_ctx=a.max_model_len)
    if (why := unavailable("vllm", s)) is not None:
        raise SystemExit(f"vllm: {why}")
    port = free_port()
    spec = launch("vllm", port, s)
    log = Path(tempfile.mkdtemp(prefix="kvseal-fair-vllm-")) / "vllm.log"
    chunk = ["--max-num-batched-tokens", mode.split("-chunk", 1)[1]] if "-chunk" in mode else []
    return ManagedServer([*spec.argv, "--scheduling-policy", "priority", *chunk], f"http://127.0.0.1:{port}",
                         spec.ready_path, str(log), env=dict(spec.env))


def one_mode(a: argparse.Namespace, mode: str, keys: Path) -> dict[str, float]:
    server: ManagedServer = vllm_server(a, mode) if mode.startswith("vllm") else ServerProc(
        ["--fairness", mode, "--api-keys", str(keys), "--max-model-len", str(a.max_model_len), *a.serve_args])
    try:
        server.wait_ready(900)
        model = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEYS['ops']}"},
                          timeout=10).json()["data"][0]["id"]
        return asyncio.run(measure(a, mode, server.url, model))
    finally:
        server.stop()


async def measure(a: argparse.Namespace, mode: str, url: str, model: str) -> dict[str, float]:
    limits = httpx.Limits(max_connections=a.flood + 64)
    # vLLM: priority scheduling, B first (a lower value is served sooner); kvseal: the tenants file decides
    vllm = mode.startswith("vllm")
    pa, pb = ({"priority": 1}, {"priority": 0}) if vllm else ({}, {})
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits,
                                 headers={"Authorization": f"Bearer {KEYS['a']}"}) as ca, \
            httpx.AsyncClient(base_url=url, timeout=3600, limits=limits,
                              headers={"Authorization": f"Bearer {KEYS['b']}"}) as cb:
        warm = make_prompts(1, a.flood_prompt, a.vocab, seed=999)
        await flood(ca, model, warm, 2, pa)  # both paths warm: templates, kernels, first steps
        await chat(cb, model, 2, pb)
        alone = await every_second(cb, model, a.alone_seconds, a.b_tokens, pb)
        prompts = make_prompts(a.flood, a.flood_prompt, a.vocab, seed={"vtc": 1, "off": 2}.get(mode, 3))
        before = {} if vllm else await asyncio.to_thread(served, url)
        a_task = asyncio.ensure_future(flood(ca, model, prompts, a.flood_tokens, pa))
        under = await every_second(cb, model, a.b_seconds, a.b_tokens, pb)
        # B's window is over; A is still busy unless it finished first
        during = {} if vllm else await asyncio.to_thread(served, url)
        a_done = a_task.done()
        a_figs = await a_task
        share_backlogged = await both_backlogged(ca, cb, model, a, pa, pb) if a.backlogged else float("nan")
    share_a = during.get("a", 0.0) - before.get("a", 0.0)
    share_b = during.get("b", 0.0) - before.get("b", 0.0)
    return {**b_figures(alone, "alone"), **b_figures(under, "flood"), **a_figs,
            "b_share_while_busy": share_b / (share_a + share_b) if share_a + share_b > 0 else float("nan"),
            "b_share_both_backlogged": share_backlogged,
            "a_busy_through_b_window": float(not a_done)}


def report(res: dict[str, dict[str, float]], cpu: str) -> str:
    cols = ["fairness", "B TTFT p50 alone", "B TTFT p99 alone", "B TTFT p50 flood", "B TTFT p99 flood",
            "B tok/s alone", "B tok/s flood", "A tok/s (prompt+out)", "B share while busy",
            "B share, both backlogged"]
    rows = [[m, *(f"{r[k] * 1e3:,.0f} ms" for k in ("b_ttft_p50_alone", "b_ttft_p99_alone", "b_ttft_p50_flood",
                                                    "b_ttft_p99_flood")),
             f"{r['b_tok_s_alone']:.1f}", f"{r['b_tok_s_flood']:.1f}", f"{r['a_tok_s']:,.0f}",
             f"{r['b_share_while_busy']:.3f}", f"{r['b_share_both_backlogged']:.3f}"] for m, r in res.items()]
    lines = [f"CPU: {cpu}", markdown_table(cols, rows)]
    if "vtc" in res and "off" in res:
        v, o = res["vtc"], res["off"]
        lines += [f"B's TTFT p99 under the flood, vtc/off: {v['b_ttft_p99_flood'] / o['b_ttft_p99_flood']:.3f}",
                  f"A's throughput, vtc/off: {v['a_tok_s'] / o['a_tok_s']:.3f} (target >= 0.9)"]
    for m in [m for m in res if m.startswith("vllm")] if "vtc" in res else []:
        v, o = res["vtc"], res[m]
        ratio = v["b_ttft_p99_flood"] / o["b_ttft_p99_flood"]
        lines += [f"B's TTFT p99 under the flood, kvseal vtc / {m}: {ratio:.3f}",
                  f"A's throughput, kvseal vtc / {m}: {v['a_tok_s'] / o['a_tok_s']:.3f}"]
    for m, r in res.items():
        bound = max(2 * r["b_ttft_p99_alone"], r["b_ttft_p99_alone"] + 1.0)
        met = "met" if r["b_ttft_p99_flood"] <= bound else "NOT met"
        lines.append(f"{m}: B's TTFT p99 under the flood {r['b_ttft_p99_flood']:.3f} s against the bound "
                     f"max(2 x alone, alone + 1 s) = {bound:.3f} s: {met}")
        if not math.isnan(r["b_share_both_backlogged"]):  # phase 3 ran
            lines.append(f"{m}: B's share while both are backlogged {r['b_share_both_backlogged']:.3f} "
                         f"(target >= 0.5 at equal weights)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fairness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flood", type=int, default=24, help="A's prompts, sent at once (issue: 200)")
    p.add_argument("--flood-prompt", type=int, default=384, help="tokens per A prompt")
    p.add_argument("--flood-tokens", type=int, default=32, help="max_tokens of each A request")
    p.add_argument("--b-seconds", type=float, default=20, help="B's chats under the flood, one a second (issue: 60)")
    p.add_argument("--alone-seconds", type=float, default=10, help="B's chats alone, one a second")
    p.add_argument("--b-tokens", type=int, default=16, help="max_tokens of each B chat")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=49152, help="the bundled model's vocabulary (random prompt ids)")
    p.add_argument("--modes", default="vtc,off")
    p.add_argument("--a-kv-share", type=float, default=1.0,
                   help="A's kv_share in the tenants file (1: none); 0.5 keeps half of each pool for others")
    p.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's --dtype (mode vllm)")
    p.add_argument("--no-backlogged", dest="backlogged", action="store_false",
                   help="skip the last phase (A and B both flood: B's share of the tokens while both are busy)")
    p.add_argument("--out", default=None, help="write the figures as JSON here too")
    p.add_argument("serve_args", nargs="*", help="more `kvseal serve` flags (after --)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "api-keys"
        keys.write_text(f"a {KEYS['a']} weight=1 kv_share={a.a_kv_share}\nb {KEYS['b']} weight=1\n"
                        f"ops {KEYS['ops']} admin\n")
        res = {m: one_mode(a, m, keys) for m in a.modes.split(",")}
    cpu = cpu_model()
    print(f"flood {a.flood} x {a.flood_prompt} tokens (max_tokens {a.flood_tokens}), B {a.b_seconds:g} s under it and "
          f"{a.alone_seconds:g} s alone (max_tokens {a.b_tokens}), A's kv_share {a.a_kv_share:g}, serve flags "
          f"{' '.join(a.serve_args) or '(defaults)'}")
    print(report(res, cpu))
    if a.out:
        clean = {m: {k: (None if math.isnan(v) else v) for k, v in r.items()} for m, r in res.items()}  # NaN: null
        Path(a.out).write_text(json.dumps({"cpu": cpu, "args": vars(a), "results": clean}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

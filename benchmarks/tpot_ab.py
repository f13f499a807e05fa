"""One stream's time per output token, alternated request by request: llama-server, `kvseal serve --unified` from this
checkout and, with --base, from another revision's package, all started once and left idle between turns.

    python -m benchmarks.tpot_ab --model qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --base main --rounds 9

Every round sends one request to each server in turn (the order rotates round by round): the same --input-len fresh
token ids to all (none sent before), --output-len tokens out, greedy, ignore_eos, streamed. TPOT = (last token's
arrival - first's) / (tokens - 1); CPU ms a token = the server tree's user + system time over that interval /
(tokens - 1), which a shared machine's queue does not inflate (a spinning thread does). Between rounds, this process
measures the read bandwidth with torch (a sum of --bw-mb of float32 in 2 MB pages, best of 5, with the servers'
thread count: benchmarks.limits.read_bandwidth); its best over the run is the limit the TPOTs are set against: bytes
read a token / TPOT.

Bytes a token: the weights every decode step reads once, from the GGUF's header: llama.cpp reads the file's blocks
of every layer and the output matrix; kvseal reads its repacked tiles (kvs_qpacked_bytes) of the same tensors. The
KV cache read is left out (at most --input-len + --output-len positions: a few MB).

On a shared machine print the load average with the table and compare medians; --json keeps every request.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from benchmarks import cpu_record
from benchmarks.common import ManagedServer, checkout, free_port, tree_cpu_s
from benchmarks.limits import read_bandwidth
from benchmarks.systems import Settings


def bytes_per_token(model: str) -> dict[str, int]:
    """{'gguf': the file's bytes of every layer tensor and the output matrix, 'kvseal': kvseal's packed tiles of
    the same tensors (float tensors as stored)}."""
    import gguf

    from kvseal.kernels import ops

    r = gguf.GGUFReader(model)
    names = {t.name for t in r.tensors}
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    out = {"gguf": 0, "kvseal": 0}
    for t in r.tensors:
        if not (t.name.startswith("blk.") or t.name == head):
            continue
        out["gguf"] += int(t.n_bytes)
        k, n = (int(x) for x in t.shape[:2]) if len(t.shape) > 1 else (int(t.shape[0]), 1)
        packed = int(ops.lib().kvs_qpacked_bytes(int(t.tensor_type), n, k)) if len(t.shape) > 1 else -1
        out["kvseal"] += packed if packed > 0 else int(t.n_bytes)
    return out


def kernel_libs(pid: int) -> list[str]:
    """The kvseal kernel libraries the process tree has mapped (their names carry the sources' hash): which build
    a side really runs."""
    out = set()
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []
    for p in procs:
        try:
            out |= {Path(m.path).name for m in p.memory_maps() if "libkvseal" in m.path}
        except psutil.Error:
            pass
    return sorted(out)


def one_request(url: str, model: str, prompt: list[int], out_len: int, pid: int) -> dict[str, Any]:
    """One streamed completion: TTFT, TPOT and the server tree's CPU ms a token between first and last token."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "min_tokens": out_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    arrivals: list[float] = []
    cpu0 = cpu1 = 0.0
    text: list[str] = []
    n = 0
    t0 = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600.0) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now, obj = time.monotonic(), json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"{url}: {obj['error']}")
            if obj.get("choices"):
                if not arrivals:
                    cpu0 = tree_cpu_s(pid)
                arrivals.append(now)
                cpu1 = tree_cpu_s(pid)
                text.append(obj["choices"][0].get("text") or "")
            if obj.get("usage"):
                n = int(obj["usage"]["completion_tokens"])
    if n != out_len or len(arrivals) < 2:
        raise RuntimeError(f"{url}: {n} tokens in {len(arrivals)} chunks, asked for {out_len}")
    steps = n - 1  # arrivals may merge tokens (a partial UTF-8 character): time over tokens, not chunks
    return {"ttft_s": arrivals[0] - t0, "tpot_s": (arrivals[-1] - arrivals[0]) / steps,
            "cpu_ms_per_token": 1e3 * (cpu1 - cpu0) / steps, "text": "".join(text)}


def servers(a: argparse.Namespace, tmp: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (argv without --port, added environment)."""
    out: dict[str, tuple[list[str], dict[str, str]]] = {}
    s = Settings(model_path=a.model)
    n = str(a.threads or os.cpu_count() or 1)  # llama-server's -t: every core unless told
    kv_threads = ["--threads", str(a.threads)] if a.threads else []  # kvseal's own default unless told
    if os.access(s.llama_server, os.X_OK) and not a.no_llama:
        out["llama-server"] = ([str(s.llama_server), "-m", a.model, "--host", "127.0.0.1", "-t", n, "-tb", n, "-np",
                                "1", "-c", "4096", "--no-cache-prompt"], {})
    trees = ([(f"kvseal @{a.base}", checkout(a.base, tmp / "base"))] if a.base else []) + [("kvseal", REPO)]
    for name, tree in trees:
        # this checkout decodes one token a step (--speculative off unless told): the bandwidth path is measured,
        # against a llama-server that does not draft either; a --base tree keeps its own defaults
        spec = ["--speculative", a.speculative] if tree == REPO else []
        out[name] = ([sys.executable, "-m", "kvseal", "serve", a.model, "--unified", "--host", "127.0.0.1",
                      *kv_threads, *spec, "--kv-pool-tokens", "8192", "--log-level", "warning"],
                     # PYTHONSAFEPATH: `python -m` would put the working directory (this checkout) ahead of PYTHONPATH,
                     # in the server and in every worker it starts
                     # a weights cache folder per side: the cache's name carries the kernels' version, and one
                     # side's would replace the other's in a shared folder
                     {"PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1",
                      "KVSEAL_WEIGHTS_CACHE_DIR": str(Path(a.cache_root or tmp) / f"weights-{len(out)}")})
    return out


REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tpot_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GGUF file (a name in ~/.cache/kvseal/models, or a path)")
    p.add_argument("--base", default=None, help="a git revision whose kvseal is served too")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=0,
                   help="threads for every server (0: their defaults: kvseal's, and every core for llama-server)")
    p.add_argument("--bw-mb", type=int, default=1024)
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--speculative", default="off", choices=["off", "lookup"],
                   help="this checkout's --speculative (default off: one token a step, the bandwidth path)")
    p.add_argument("--cache-root", default=None,
                   help="where each side's weights cache folder goes (kept between runs; default: a temp folder)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not os.path.exists(a.model):
        a.model = str(Path.home() / ".cache" / "kvseal" / "models" / a.model)
    import random

    import httpx

    rng = random.Random(0)
    res: dict[str, Any] = {"cpu": cpu_record.collect(), "model": a.model, "base": a.base, "threads": a.threads,
                           "bytes_per_token": bytes_per_token(a.model), "bandwidth": [], "bandwidth_core": [],
                           "loads": [], "runs": {}}
    with tempfile.TemporaryDirectory(prefix="kvseal-tpot-") as tmp:
        specs = servers(a, Path(tmp))
        live: dict[str, tuple[ManagedServer, str, str]] = {}  # name -> (server, url, served model id)
        try:
            for name, (cmd, env) in specs.items():
                port = free_port()
                srv = ManagedServer([*cmd, "--port", str(port)], f"http://127.0.0.1:{port}", "/health",
                                    str(Path(tmp) / f"{name.replace(' ', '_')}.log"), env)
                srv.wait_ready(1800.0)
                url = f"http://127.0.0.1:{port}"
                live[name] = (srv, url, httpx.get(url + "/v1/models", timeout=10.0).json()["data"][0]["id"])
                one_request(url, live[name][2], [rng.randrange(1000, 20000) for _ in range(a.input_len)], 8,
                            srv.p.pid)  # warm-up: first calls, page faults
                res.setdefault("kernels", {})[name] = kernel_libs(srv.p.pid)
                print(f"{name}: ready, kernels {res['kernels'][name] or '-'}", flush=True)
            names = list(live)
            res["runs"] = {n: [] for n in names}
            for r in range(a.rounds):
                prompt = [rng.randrange(1000, 20000) for _ in range(a.input_len)]
                res["loads"].append(os.getloadavg()[0])
                for name in names[r % len(names):] + names[:r % len(names)]:
                    srv, url, model = live[name]
                    run = one_request(url, model, prompt, a.output_len, srv.p.pid)
                    res["runs"][name].append(run)
                    print(f"round {r + 1} {name:22s} TPOT {run['tpot_s'] * 1e3:6.1f} ms  CPU "
                          f"{run['cpu_ms_per_token']:6.1f} ms/token  TTFT {run['ttft_s'] * 1e3:6.0f} ms  "
                          f"(load {res['loads'][-1]:.1f})", flush=True)
                torch.set_num_threads(1)
                res["bandwidth_core"].append(read_bandwidth(a.bw_mb, time.thread_time)[0])
                torch.set_num_threads(a.threads or os.cpu_count() or 1)
                res["bandwidth"].append(read_bandwidth(a.bw_mb, time.perf_counter)[0])
        finally:
            for srv, _, _ in live.values():
                srv.stop()
    report(res)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


def report(res: dict[str, Any]) -> None:
    """Medians per system; GB/s two ways: bytes a token over TPOT against the best wall-clock bandwidth with the
    servers' threads, and over CPU time a token against one core's best (thread CPU time)."""
    bw, core = max(res["bandwidth"]), max(res["bandwidth_core"])
    bpt = res["bytes_per_token"]
    print(cpu_record.header(res["cpu"]))
    print(f"load average {min(res['loads']):.1f} to {max(res['loads']):.1f}; read bandwidth (best, 2 MB pages): "
          f"{bw / 1e9:.1f} GB/s wall with {res['threads'] or 'all'} threads, {core / 1e9:.1f} GB/s a core in CPU "
          f"time; bytes a token: kvseal {bpt['kvseal'] / 1e6:.0f} MB, file {bpt['gguf'] / 1e6:.0f} MB")
    med = {n: {k: statistics.median(r[k] for r in runs) for k in ("tpot_s", "cpu_ms_per_token", "ttft_s")}
           for n, runs in res["runs"].items()}
    ref = med.get("llama-server", {})
    kv = [n for n in res["runs"] if n.startswith("kvseal")]
    print(f"{'system':22s} {'TPOT ms':>8s} {'vs llama':>9s} {'GB/s':>5s} {'of bw':>6s} {'CPU ms/tok':>11s} "
          f"{'vs llama':>9s} {'GB/CPU-s':>8s} {'of core':>8s} {'TTFT ms':>8s}  same text as {kv[0] if kv else '-'}")
    first = res["runs"][kv[0]] if kv else []
    for n, m in med.items():
        b = bpt["gguf"] if n == "llama-server" else bpt["kvseal"]
        wall, cpu = b / m["tpot_s"], b / (m["cpu_ms_per_token"] / 1e3)
        vs = [m[k] / ref[k] if ref else float("nan") for k in ("tpot_s", "cpu_ms_per_token")]
        same = (f"{sum(r['text'] == f['text'] for r, f in zip(res['runs'][n], first, strict=True))}/{len(first)}"
                if n in kv else "-")
        print(f"{n:22s} {m['tpot_s'] * 1e3:8.1f} {vs[0]:8.2f}x {wall / 1e9:5.1f} {wall / bw:6.0%} "
              f"{m['cpu_ms_per_token']:11.1f} {vs[1]:8.2f}x {cpu / 1e9:8.1f} {cpu / core:8.0%} "
              f"{m['ttft_s'] * 1e3:8.0f}  {same}")
    res["medians"] = med


if __name__ == "__main__":
    raise SystemExit(main())

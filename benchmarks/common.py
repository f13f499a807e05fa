"""Helpers shared by the benchmarks: statistics, per-request latency metrics, tables, prompts, machine facts,
and server subprocesses on loopback ports. Everything here except ManagedServer, ServerProc and
stream_completion is pure (no timing, no I/O) so it can be unit-tested on fixed inputs.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# the pure pieces `kvseal bench` needs live in the package; the studies use them from there
from kvseal.bench.load.stats import (  # noqa: F401 (re-exported)
    Arrivals,
    fmt_num,
    host_info,
    markdown_table,
    percentile,
    request_latency,
)

# -- statistics ----------------------------------------------------------------------------------------


def median(xs: Sequence[float]) -> float:
    return percentile(xs, 50.0)


# -- one run of N requests -------------------------------------------------------------------------------


def run_stats(requests: Sequence[tuple[float, Arrivals, int]]) -> dict[str, float]:
    """Aggregate one run of concurrent requests, each (t_send, arrivals, output tokens)."""
    start = min(t for t, _, _ in requests)
    end = max(a[-1][0] for _, a, _ in requests if a)
    tokens = sum(n for _, _, n in requests)
    lat = [request_latency(t, a, n) for t, a, n in requests]
    ttft = [x for x, _ in lat if not math.isnan(x)]
    tpot = [y for _, y in lat if not math.isnan(y)]
    return {"tok_s": tokens / (end - start), "tokens": float(tokens), "wall_s": end - start,
            "ttft_median": median(ttft), "ttft_p99": percentile(ttft, 99),
            "tpot_median": median(tpot), "tpot_p99": percentile(tpot, 99)}


def median_of_runs(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Key by key median over repeats (NaNs dropped); the raw runs stay in the JSON next to it."""
    keys = runs[0].keys() if runs else []
    out = {}
    for k in keys:
        vals = [r[k] for r in runs if not math.isnan(r[k])]
        out[k] = median(vals) if vals else math.nan
    return out


# -- formatting ----------------------------------------------------------------------------------------


def fmt_ms(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "—"
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}"


def fmt_ratio(x: float | None, ref: float | None) -> str:
    """'1,234.5 (2.06×)': a throughput and its ratio to the reference; no ratio without a reference."""
    if x is None or math.isnan(x):
        return "—"
    if ref is None or math.isnan(ref) or ref == 0:
        return fmt_num(x)
    return f"{fmt_num(x)} ({x / ref:.2f}×)"


# -- workload ------------------------------------------------------------------------------------------


def make_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """n distinct prompts of exactly `length` token ids, away from the low (special) ids."""
    rng = random.Random(seed)
    lo, hi = min(256, vocab_size // 4), vocab_size - 1
    return [[rng.randint(lo, hi) for _ in range(length)] for _ in range(n)]


def left_pad(batch: Sequence[Sequence[int]], pad_id: int) -> tuple[list[list[int]], list[list[int]]]:
    """Left-pad to the longest: (input_ids, attention_mask), as decoder-only batched generate wants."""
    width = max(len(p) for p in batch)
    ids = [[pad_id] * (width - len(p)) + list(p) for p in batch]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in batch]
    return ids, mask


def machine_info() -> dict[str, Any]:
    """host_info() plus the torch (and transformers) build the in-process benchmarks ran on."""
    import torch

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    return {**host_info(), "torch_threads": torch.get_num_threads(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "transformers": tf_version}


def hf_model(ckpt: Any, dtype: str) -> Any:
    """transformers' model class on kvseal's weights, dequantized (the e2e tests check both loaders agree)."""
    import torch
    import transformers

    a = ckpt.arch
    family = "Qwen2" if a.family == "qwen2" else "Llama"
    cfg_cls: Any = getattr(transformers, f"{family}Config")
    model_cls: Any = getattr(transformers, f"{family}ForCausalLM")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": a.rope_theta, **dict(a.rope_scaling or ())}
    rope["rope_type"] = rope.pop("type", rope["rope_type"])
    kw = {} if a.family == "qwen2" else {"attention_bias": a.attention_bias, "head_dim": a.head_dim}
    cfg = cfg_cls(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                  num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads,
                  rope_parameters=rope, rms_norm_eps=a.rms_eps, max_position_embeddings=a.max_position,
                  tie_word_embeddings=a.tie_embeddings, **kw)
    model = model_cls(cfg)
    state = {**ckpt.weights, **{n: q.dequantize() for n, q in ckpt.packed.items()}}  # the reference's own copy
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (a.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"weights do not fit transformers' model: missing {missing}, unexpected {unexpected}")
    return model.to(getattr(torch, dtype)).eval()


# -- a kvseal server on loopback -------------------------------------------------------------------------


def checkout(rev: str, out: Path) -> Path:
    """The kvseal package of git revision rev, extracted into out: a PYTHONPATH for that revision (run it with
    PYTHONSAFEPATH=1, or `python -m` puts the working directory ahead of it)."""
    repo = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "kvseal"], capture_output=True,
                             check=True).stdout
    out.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def tree_cpu_s(pid: int) -> float:
    """user + system seconds of a process and all its live descendants so far."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return total
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ManagedServer:
    """A server subprocess in its own process group (a disaggregated kvseal fleet stops as one)."""

    def __init__(self, argv: list[str], url: str, ready_path: str, log_path: str,
                 env: dict[str, str] | None = None) -> None:
        """`env` is added to this process's environment."""
        self.argv, self.url, self.ready_path, self.log_path = argv, url, ready_path, log_path
        self._log = open(log_path, "wb")  # noqa: SIM115  (closed in stop())
        try:
            self.p = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        except OSError:
            self._log.close()
            raise

    def output(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def wait_ready(self, timeout: float) -> float:
        """Seconds until `ready_path` answered 200; raises when the process exits or time runs out."""
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.argv[2:4]} exited with {self.p.returncode}:\n{self.output()[-3000:]}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.url}{self.ready_path} not ready after {timeout:.0f}s:\n{self.output()[-3000:]}")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM to the group, SIGKILL after `timeout`; the exit code (negative: the signal)."""
        if self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(10)
        self._log.close()
        return self.p.returncode


class ServerProc(ManagedServer):
    """`python -m kvseal serve ... --port P` on a free port, its log in a temp file removed by stop()."""

    def __init__(self, args: list[str]) -> None:
        self.port = free_port()
        self.model = ""  # the served model id, known once ready()
        with tempfile.NamedTemporaryFile(prefix="kvseal-bench-", suffix=".log", delete=False) as log:
            pass
        super().__init__([sys.executable, "-m", "kvseal", "serve", *args, "--port", str(self.port),
                          "--log-level", "warning"], f"http://127.0.0.1:{self.port}", "/health", log.name)

    def ready(self, timeout: float = 600.0) -> ServerProc:
        import httpx

        self.wait_ready(timeout)
        self.model = httpx.get(self.url + "/v1/models", timeout=10.0).json()["data"][0]["id"]
        return self

    def stop(self, timeout: float = 30.0) -> int | None:
        code = super().stop(timeout)
        os.unlink(self.log_path)
        return code


async def stream_completion(client: Any, url: str, model: str, prompt: list[int],
                            max_tokens: int) -> tuple[float, Arrivals, int]:
    """One streamed /v1/completions request (greedy, ignore_eos, usage at the end): (t_send, arrivals, tokens).

    Each SSE chunk with a choice counts as one arrival; the token count comes from the usage chunk, since a
    delta whose text is still empty (a partial UTF-8 sequence) is not sent as a chunk of its own."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    arrivals: Arrivals = []
    n = 0
    t_send = time.monotonic()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now, obj = time.monotonic(), json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            if obj.get("choices"):
                arrivals.append((now, 1))
            if obj.get("usage"):
                n = int(obj["usage"]["completion_tokens"])
    return t_send, arrivals, n

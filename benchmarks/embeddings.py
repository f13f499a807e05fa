"""Embeddings throughput side by side, in one run: kvseal's /v1/embeddings (`kvseal serve --embed-model`),
llama.cpp's llama-server --embedding on the same model converted to GGUF (float32, llama.cpp's own
convert_hf_to_gguf.py from the vendored tree of the llama-cpp-python sdist), and sentence-transformers in-process.

The workload: one request of 64 sentences of 32 to 128 tokens (uniform, seeded; words drawn from the model's own
vocabulary), texts a second over `--rounds` rounds after a warm-up, each system with the same CPU threads. The
rounds go system by system in turn (kvseal, llama-server, sentence-transformers, then again), so load from
elsewhere on the machine falls on all of them alike; the table gives each one's median and its ratio to
llama-server's. Beside it, texts per CPU-second each system used (its processes' user + system time over the
round): on a machine shared with other work, how much CPU a system gets varies, how much it needs does not.
Every answer is checked against sentence-transformers' embeddings (cosine).

    python -m benchmarks.embeddings                      # threads 1 and 2, 7 rounds each
    python -m benchmarks.embeddings --threads 2 --rounds 9 --json docs/bench/embeddings_DATE.json

Needs llama-server (scripts/setup_baselines.sh llama-server) and the model (scripts/fetch_models.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.common import ManagedServer, ServerProc, free_port
from benchmarks.cpu_record import collect, header

ROOT = Path(__file__).resolve().parents[1]
PEERS = Path(os.environ.get("PEERS", Path.home() / ".cache" / "kvseal-peers"))
CONVERT = "llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"


def model_folder() -> Path:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "fetch_models.py"), "all-minilm-l6-v2"],
                         check=True, capture_output=True, text=True).stdout.strip().splitlines()
    return Path(out[-1])


def sentences(tokenizer: Any, n: int = 64, lo: int = 32, hi: int = 128, seed: int = 0) -> list[str]:
    """n texts of lo..hi tokens each ([CLS] and [SEP] included), words from the vocabulary, seeded."""
    vocab = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target, words = rng.randint(lo, hi), []
        while len(tokenizer.encode(" ".join(words)).ids) < target:
            words.append(rng.choice(vocab))
        out.append(" ".join(words))
    return out


def gguf_of(folder: Path, out: Path) -> Path:
    """The folder as a float32 GGUF, converted once with llama.cpp's own script."""
    if out.is_file():
        return out
    scripts = sorted(PEERS.glob(CONVERT))
    if not scripts:
        raise SystemExit(f"no {CONVERT} under {PEERS}: run scripts/setup_baselines.sh llama-server")
    subprocess.run([sys.executable, str(scripts[-1]), str(folder), "--outtype", "f32", "--outfile", str(out)],
                   check=True, capture_output=True)
    return out


def post(url: str, model: str, texts: list[str]) -> tuple[float, np.ndarray]:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/embeddings", json={"model": model, "input": texts, "encoding_format": "float"},
                   timeout=600)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dt, np.array([d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])],
                        dtype=np.float32)


def cos_min(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process and its children (None: this process alone, every thread of it)."""
    import psutil

    procs = [psutil.Process(pid)] if pid is not None else [psutil.Process()]
    if pid is not None:
        procs += procs[0].children(recursive=True)
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


def run(threads: int, rounds: int, folder: Path, gguf: Path, texts: list[str]) -> dict[str, Any]:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    st = SentenceTransformer(str(folder), device="cpu")
    kvseal = ServerProc(["--unified", "--embed-model", str(folder), "--embed-threads", str(threads),
                         "--threads", "1"]).ready()
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="llama-embed-", suffix=".log", delete=False).name  # noqa: SIM115
    llama = ManagedServer([str(PEERS / "bin" / "llama-server"), "-m", str(gguf), "--embedding", "--port",
                           str(port), "-t", str(threads), "-tb", str(threads)], f"http://127.0.0.1:{port}",
                          "/health", log, env={"OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"]})
    try:
        llama.wait_ready(300)
        systems = {
            "kvseal": lambda: post(kvseal.url, folder.name, texts),
            "llama-server": lambda: post(llama.url, "x", texts),
            "sentence-transformers": lambda: _st(st, texts),
        }
        pids = {"kvseal": kvseal.p.pid, "llama-server": llama.p.pid, "sentence-transformers": None}
        reference = _st(st, texts)[1]
        times: dict[str, list[float]] = {k: [] for k in systems}
        per_cpu: dict[str, list[float]] = {k: [] for k in systems}  # texts per CPU-second the system used
        agreement: dict[str, float] = {}
        for k, f in systems.items():  # warm-up
            agreement[k] = cos_min(f()[1], reference)
        for _ in range(rounds):
            for k, f in systems.items():
                cpu = cpu_seconds(pids[k])
                dt, _ = f()
                times[k].append(len(texts) / dt)
                per_cpu[k].append(len(texts) / max(cpu_seconds(pids[k]) - cpu, 1e-9))
    finally:
        kvseal.stop()
        llama.stop()
        os.unlink(log)
    return {"threads": threads, "texts_per_s": times, "median": {k: statistics.median(v) for k, v in times.items()},
            "texts_per_cpu_s": per_cpu, "median_per_cpu_s": {k: statistics.median(v) for k, v in per_cpu.items()},
            "cosine_min_vs_sentence_transformers": agreement}


def _st(st: Any, texts: list[str]) -> tuple[float, np.ndarray]:
    t0 = time.perf_counter()
    out = st.encode(texts, batch_size=len(texts), convert_to_numpy=True)
    return time.perf_counter() - t0, out


def table(results: list[dict[str, Any]]) -> str:
    lines = [("| threads | system | texts/s (median) | min / max of rounds | vs llama-server | texts per CPU-second "
              "| vs llama-server | min cosine vs ST |"), "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        ref, ref_cpu = r["median"]["llama-server"], r["median_per_cpu_s"]["llama-server"]
        for k, v in r["median"].items():
            lo, hi = min(r["texts_per_s"][k]), max(r["texts_per_s"][k])
            c = r["median_per_cpu_s"][k]
            lines.append(f"| {r['threads']} | {k} | {v:.1f} | {lo:.1f} / {hi:.1f} | {v / ref:.2f}x | {c:.1f} | "
                         f"{c / ref_cpu:.2f}x | {r['cosine_min_vs_sentence_transformers'][k]:.7f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2", help="comma-separated CPU thread counts, each a run")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--gguf", default=str(Path(tempfile.gettempdir()) / "all-MiniLM-L6-v2-f32.gguf"))
    p.add_argument("--json", default=None, help="write the rounds and the machine record here")
    p.add_argument("--omp-wait-policy", default="PASSIVE", choices=["PASSIVE", "ACTIVE"],
                   help="OMP_WAIT_POLICY for all three (each uses OpenMP threads; kvseal's embed worker defaults to "
                        "PASSIVE)")
    a = p.parse_args(argv)
    os.environ["OMP_WAIT_POLICY"] = a.omp_wait_policy  # before torch loads here, and for both servers
    import tokenizers

    folder = model_folder()
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    texts = sentences(tok)
    lengths = [len(tok.encode(t).ids) for t in texts]
    gguf = gguf_of(folder, Path(a.gguf))
    machine = collect()
    results = [run(int(t), a.rounds, folder, gguf, texts) for t in a.threads.split(",")]
    print(header(machine))
    print(f"{len(texts)} sentences of {min(lengths)}-{max(lengths)} tokens ({sum(lengths)} in all), one request "
          f"each round, {a.rounds} rounds, OMP_WAIT_POLICY={a.omp_wait_policy}; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(table(results))
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": machine, "lengths": lengths, "runs": results,
                                            "omp_wait_policy": a.omp_wait_policy}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

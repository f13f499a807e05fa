"""CPU seconds of S streams through the engine's own step loop (kvseal.LLM, in process): a figure that a shared
machine does not distort, for before/after comparisons of the kernels where wall-clock tokens a second cannot be
measured.

    python benchmarks/streams_cpu.py --model qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --streams 32 \\
        --prompt-len 64 --decode 16

One thread (torch's and the kernels'; --threads N for the server's count), process CPU time, and wall time. S
random prompts of --prompt-len token ids, greedy, --decode + 1 tokens each (ignore_eos): a prefill-only run
(max_tokens 1) first, then the whole run; decode CPU = the difference, so a decode step is S rows through every
layer and the lm_head. Prints the instruction set, CPU seconds and a hash of every output token, which must not
change with the kernels (the arithmetic's bits). Imports only kvseal, so it can run against another checkout's
package (PYTHONPATH=that checkout).

--perf FILE records the whole run's second pass (prefill of S x --prompt-len, then the decode steps; with a short
prompt, decode steps almost only) with `perf record -g` on this process, then prints its CPU samples by part of
the step (PARTS: the products, barrier waits, attention, SwiGLU, sampling, ...; `perf report -i FILE` for the rest).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import re
import signal
import subprocess
import time

import torch

# (part of a step, how a perf sample's shared object and symbol name it), first match wins
PARTS = (
    ("products: the multiply", "libkvseal", ("vnni_rows16", "qamx_rows16", "tile_avx", "qvec")),
    ("products: unpacking tiles", "libkvseal", ("qup_unpack",)),
    ("products: x quantized and laid out, dispatch", "libkvseal", ("qlinear_mat", "qup_", "tile_at")),
    ("attention", "libkvseal", ("attend", "attention")),
    ("SwiGLU", "libkvseal", ("silu",)),
    ("norms, RoPE, KV writes, the C forward", "libkvseal", ("",)),
    ("a thread waiting at a barrier (libgomp)", "libgomp", ("",)),
    ("sampling (torch argmax)", "libtorch", ("argmax",)),
    ("torch, other (embedding rows, ...)", "libtorch", ("",)),
    ("Python", "python", ("",)),
)


def perf_parts(path: str) -> dict[str, float]:
    """Shares of a perf recording's samples by PARTS (the rest: "other")."""
    report = subprocess.run(["perf", "report", "-i", path, "--no-children", "--sort", "dso,sym", "--stdio", "-g",
                             "none"], capture_output=True, text=True, check=True).stdout
    shares: dict[str, float] = {}
    for line in report.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[.\]\s+(.*)", line)
        if not m:
            continue
        share, dso, sym = float(m[1]), m[2], m[3]
        part = next((name for name, lib, syms in PARTS if lib in dso and any(k in sym for k in syms)), "other")
        shares[part] = shares.get(part, 0.0) + share
    return shares


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--perf", default=None, help="perf record the whole run into this file")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from kvseal import LLM, SamplingParams
    from kvseal.kernels import ops

    s, n_in, n_out = a.streams, a.prompt_len, a.decode
    llm = LLM(a.model, arithmetic="fast", max_model_len=n_in + n_out + 16, prefix_cache=False,
              pool_tokens=s * (n_in + n_out + 32))
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(n_in)] for _ in range(s)]

    def run(n: int) -> tuple[float, float, list[list[int]]]:
        t, w = time.process_time(), time.perf_counter()
        out = llm.generate(prompts, SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True))
        return time.process_time() - t, time.perf_counter() - w, [o.outputs[0].token_ids for o in out]

    run(2)  # warm-up: first calls, page faults
    pre, pre_wall, _ = run(1)
    perf = None
    if a.perf:
        perf = subprocess.Popen(["perf", "record", "-F", "499", "-g", "-o", a.perf, "-p", str(os.getpid())],
                                stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # perf attaches
    full, full_wall, toks = run(n_out + 1)
    if perf:
        perf.send_signal(signal.SIGINT)
        perf.wait()
    dec, dec_wall = full - pre, full_wall - pre_wall
    digest = hashlib.sha256(str(toks).encode()).hexdigest()[:12]
    print(f"isa {ops.qisa()}, {a.threads} thread(s): prefill {s}x{n_in} tokens {pre:.1f} CPU s "
          f"({s * n_in / pre:.1f} tok/CPU-s); decode {n_out} steps x {s} streams {dec:.1f} CPU s "
          f"({s * n_out / dec:.1f} tok/CPU-s, {dec / n_out * 1e3:.0f} CPU ms/step, {dec_wall / n_out * 1e3:.0f} wall "
          f"ms/step); tokens {digest}")
    if a.perf:
        for part, share in sorted(perf_parts(a.perf).items(), key=lambda kv: -kv[1]):
            print(f"  {share:5.1f}%  {part}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

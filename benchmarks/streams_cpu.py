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
prompt, decode steps almost only) with `perf record -g` on this process, for `perf report -i FILE`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import subprocess
import time

import torch


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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The engine's loop thread (what `kvseal serve --unified` runs) multiplies every step on the threads torch has:
prompt chunks and decode steps of many requests alike. Leaving a core to the HTTP side cost 1.32x the tok/s at 32
streams on the 1.5B (docs/benchmarks.md, issue 32)."""

from __future__ import annotations

import subprocess
import sys
import threading

import torch

from kvseal.engine.loop import EngineLoop
from kvseal.engine.runner import StepResult
from kvseal.engine.scheduler import Batch
from kvseal.kernels import ops
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire.messages import GenerateDelta, GenerateRequest, SamplingParams
from tests.unit.conftest import make_engine


def test_every_step_of_the_loop_runs_on_the_threads_torch_has(tiny: Checkpoint) -> None:
    e = make_engine(tiny, budget=64)
    assert e.kernels == "native"
    seen: list[tuple[int, int, int]] = []  # (requests, tokens, kernel threads) of every step
    run = e.runner.run

    def counted(batch: Batch) -> StepResult:
        seen.append((len(batch.seqs), sum(batch.num_new), ops.lib().kvs_get_threads()))
        return run(batch)

    e.runner.run = counted  # type: ignore[method-assign]
    ended: set[str] = set()
    done = threading.Event()

    def on_output(deltas: list[GenerateDelta]) -> None:
        ended.update(d.request_id for d in deltas if d.final is not None)
        if len(ended) == 6:
            done.set()

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    ops.set_threads(1)  # the loop thread must not inherit this: it takes torch's count
    loop = EngineLoop(e, on_output)
    try:
        loop.start()
        for i in range(6):
            loop.submit(GenerateRequest(f"r{i}", list(range(3 + i, 33 + i)),
                                        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
        assert done.wait(60), seen
    finally:
        loop.stop()
        torch.set_num_threads(before)
        ops.set_threads(before)
    assert any(k >= 3 and t <= 2 * k for k, t, _ in seen), seen  # decode steps of many requests ran (with drafts)
    assert {n for _, _, n in seen} == {2}, seen


_TEAMS = """
import os, sys, threading, torch
from kvseal.kernels import ops
def threads(): return len(os.listdir("/proc/self/task"))
torch.set_num_threads(2)
a = torch.randn(512, 512)
n = ops.one_thread_here() if sys.argv[1] == "one" else 2
t0 = threads()
(a @ a).sum(); ops.lib()  # work on this thread, as the engine's load is
t1 = threads()
seen = []
def loop():
    torch.set_num_threads(n)  # what EngineLoop(threads=n) does first
    ops.match_torch_threads()
    seen.append(f"{torch.get_num_threads()}/{ops.lib().kvs_get_threads()}")
    for _ in range(3): (a @ a).sum()
    seen.append(threads())
th = threading.Thread(target=loop); th.start(); th.join()
print(t0, t1, *seen)
"""


def _teams(mode: str) -> tuple[int, int, str, int]:
    out = subprocess.run([sys.executable, "-c", _TEAMS, mode], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    t0, t1, counts, t2 = out.stdout.split()
    return int(t0), int(t1), counts, int(t2)


def test_the_loading_thread_starts_no_openmp_team_beside_the_loops() -> None:
    """libgomp spins at a barrier only while a process holds no more OpenMP threads than CPUs: the thread that loads
    the engine and hands it to a loop thread (`kvseal serve --unified`) must not start a team of its own."""
    t0, t1, counts, t2 = _teams("one")
    assert t1 == t0  # the load's work started no OpenMP thread
    assert counts == "2/2"  # the loop thread takes torch's count
    assert t2 == t0 + 2  # the loop thread and its one OpenMP worker, nothing else
    t0, t1, _, t2 = _teams("none")
    assert t1 == t0 + 1 and t2 == t0 + 3  # without it the same work starts a second team (the test sees it)

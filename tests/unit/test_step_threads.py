"""The unified server's engine takes every core for prompt chunks and for steps of a few requests, and leaves one to
the HTTP side on decode steps of many requests (engine.StepThreads)."""

from __future__ import annotations

from kvseal.engine.engine import StepThreads
from kvseal.engine.runner import StepResult
from kvseal.engine.scheduler import Batch
from kvseal.kernels import ops
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire.messages import GenerateRequest, SamplingParams
from tests.unit.conftest import make_engine


def _threads_per_step(tiny: Checkpoint, threads: StepThreads, requests: int) -> list[tuple[int, int]]:
    """(requests in the step, threads it ran on) for every step of `requests` 30-token prompts, 3 tokens each."""
    e = make_engine(tiny, budget=64)
    assert e.kernels == "native"
    e.step_threads = threads
    for i in range(requests):
        e.add_request(GenerateRequest(f"r{i}", list(range(3 + i, 33 + i)), SamplingParams(max_tokens=3,
                                                                                          temperature=0.0)))
    seen = []
    run = e.runner.run

    def counted(batch: Batch) -> StepResult:
        seen.append((len(batch.seqs), ops.lib().kvs_get_threads()))
        return run(batch)

    e.runner.run = counted  # type: ignore[method-assign]
    while e.has_work():
        e.step()
    return seen


def test_threads_follow_the_size_of_each_step(tiny: Checkpoint) -> None:
    seen = [n for _, n in _threads_per_step(tiny, StepThreads(small=1, big=2, big_from=20, few=0), 1)]
    assert seen[0] == 2 and seen[1:] == [1] * (len(seen) - 1)  # the 30-token prompt, then single-token steps


def test_a_step_of_a_few_requests_takes_every_core(tiny: Checkpoint) -> None:
    """One stream's decode is bound by reading the weights: both cores read (29.3 GB/s here against one core's 15)."""
    assert {n for _, n in _threads_per_step(tiny, StepThreads(small=1, big=2, big_from=1000, few=1), 1)} == {2}
    # five requests, prompts under big_from: a step of more than `few` leaves a core, one of `few` or fewer does not
    seen = _threads_per_step(tiny, StepThreads(small=1, big=2, big_from=1000, few=2), 5)
    assert any(k > 2 for k, _ in seen) and any(k <= 2 for k, _ in seen)
    assert all(n == (2 if k <= 2 else 1) for k, n in seen), seen

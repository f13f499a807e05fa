"""The unified server's engine takes every core for prompt chunks and leaves one to the HTTP side on small steps."""

from __future__ import annotations

from kvseal.kernels import ops
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire.messages import GenerateRequest, SamplingParams
from tests.unit.conftest import make_engine


def test_threads_follow_the_size_of_each_step(tiny: Checkpoint) -> None:
    e = make_engine(tiny, budget=64)
    assert e.kernels == "native"
    e.step_threads = (1, 2, 20)
    e.add_request(GenerateRequest("r", list(range(3, 33)), SamplingParams(max_tokens=3, temperature=0.0)))
    seen = []
    while e.has_work():
        e.step()
        seen.append(ops.lib().kvs_get_threads())
    assert seen[0] == 2 and seen[1:] == [1] * (len(seen) - 1)  # the 30-token prompt, then single-token steps

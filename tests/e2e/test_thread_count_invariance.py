"""The fast arithmetic computes the same bits on any number of threads, changed from one step to the next: what
lets `kvseal serve`'s workers lend each other idle cores (kvseal/worker/cores.py) without a token changing. Two
engines on the bundled model take the same requests; one steps on one thread, the other on 2, 1, 2, ... threads:
after every step the same tokens and the same KV pool bytes."""

from __future__ import annotations

import pytest
import torch

from kvseal.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvseal.engine.engine import Engine
from kvseal.kernels import ops
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire.messages import GenerateRequest, SamplingParams

pytestmark = pytest.mark.e2e


def _engine(ck: Checkpoint) -> Engine:
    e = Engine(EngineConfig(model=ModelConfig(kernels="native", arithmetic="fast"),
                            cache=CacheConfig(page_size=16, pool_tokens=8192),
                            scheduler=SchedulerConfig(max_num_batched_tokens=256)), ck)
    assert e.arithmetic.fast
    return e


def _threads(n: int) -> None:
    torch.set_num_threads(n)
    ops.set_threads(n)  # what WorkerServer._step_threads does before a step with lent cores
    assert ops.lib().kvs_get_threads() == n and torch.get_num_threads() == n


def test_fast_steps_are_bit_identical_on_one_thread_and_on_a_changing_count(smol: Checkpoint) -> None:
    before = torch.get_num_threads()
    one, lent = _engine(smol), _engine(smol)
    g = torch.Generator().manual_seed(1)
    # prompts past one chunk (prefill steps of 256 rows), and enough requests that decode steps have many rows
    prompts = [torch.randint(1000, 20000, (n,), generator=g).tolist() for n in (600, 300, 90, 40, 17, 5)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for e in (one, lent):
        for i, ids in enumerate(prompts):
            e.add_request(GenerateRequest(f"r{i}", ids, params))
    got: dict[str, list[int]] = {}
    steps = 0
    try:
        while one.has_work() or lent.has_work():
            _threads(1)
            a = one.step()
            _threads(2 if steps % 2 == 0 else 1)
            b = lent.step()
            steps += 1
            assert [(d.request_id, d.token_ids) for d in a] == [(d.request_id, d.token_ids) for d in b]
            for d in a:
                got.setdefault(d.request_id, []).extend(d.token_ids)
            assert torch.equal(one.pool.k, lent.pool.k) and torch.equal(one.pool.v, lent.pool.v)
    finally:
        _threads(before)
    assert steps >= 20 and all(len(t) == 20 for t in got.values()) and len(got) == len(prompts)

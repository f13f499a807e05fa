"""The one-call decode step (kvs_decode_forward) against the op-by-op native path, on the bundled model:
the same tokens and, after every step, the same KV pool bytes. Both run the same C ops in the same order, so
anything short of bit equality means the fused step computes something else."""

from __future__ import annotations

import pytest
import torch

from kvseal.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvseal.engine.engine import Engine
from kvseal.kernels import ops
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire.messages import GenerateRequest, SamplingParams

pytestmark = pytest.mark.e2e


def _engine(ck: Checkpoint, fused: bool) -> Engine:
    e = Engine(EngineConfig(model=ModelConfig(kernels="native", arithmetic="exact"),
                            cache=CacheConfig(page_size=16, pool_tokens=2048),
                            # no drafts: a step with one is not decode-only (one row per request), and this test
                            # counts the decode-only steps that took the one-call path
                            scheduler=SchedulerConfig(max_num_batched_tokens=64, speculative="off")), ck)
    assert e.model._c_layers is not None  # the bundled model's matrices are all packed
    if not fused:
        e.model._c_layers = None
    return e


def test_fused_decode_step_is_bit_identical_to_the_op_by_op_path(smol: Checkpoint,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real = ops.decode_forward

    def counted(*args: object, **kw: object) -> None:
        calls["n"] += 1
        real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ops, "decode_forward", counted)
    fused, plain = _engine(smol, True), _engine(smol, False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 20000, (n,), generator=g).tolist() for n in (5, 40, 70)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for e in (fused, plain):
        for i, ids in enumerate(prompts):
            e.add_request(GenerateRequest(f"r{i}", ids, params))
    got: dict[str, list[int]] = {}
    while fused.has_work() or plain.has_work():
        a, b = fused.step(), plain.step()
        assert [(d.request_id, d.token_ids) for d in a] == [(d.request_id, d.token_ids) for d in b]
        for d in a:
            got.setdefault(d.request_id, []).extend(d.token_ids)
        assert torch.equal(fused.pool.k, plain.pool.k) and torch.equal(fused.pool.v, plain.pool.v)
    assert calls["n"] >= 20  # most steps were decode-only and took the one-call path
    assert all(len(t) == 24 for t in got.values()) and len({tuple(t) for t in got.values()}) == 3

"""The fast arithmetic (kvseal/kernels/arithmetic.py) on the bundled model.

- Batch invariance: a request's greedy tokens are the same alone and sharing steps with others, whatever the
  chunk size that splits its prompt (the property `kvseal audit --strict` checks over HTTP).
- The one-call step (forward.c) is bit for bit the op-by-op path: same tokens, same pool bytes after every step.
- It answers like the exact arithmetic on plain questions (agreement is measured by benchmarks.agreement).
- bfloat16 KV: half the bytes per token, the same answers as float32 KV on plain questions, pages scrubbed.
- A step whose spans name a page outside the pool, or a slot that is not the row's place in its own table, is
  refused before the first write: the pools are untouched.
"""

from __future__ import annotations

import pytest
import torch

from kvseal import llm as api
from kvseal.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvseal.engine.engine import Engine
from kvseal.kernels import ops
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire.messages import GenerateRequest, SamplingParams

pytestmark = pytest.mark.e2e


def _engine(ck: Checkpoint, budget: int = 512, kv_dtype: str = "auto", arithmetic: str = "fast",
            pool: int = 4096) -> Engine:
    e = Engine(EngineConfig(model=ModelConfig(arithmetic=arithmetic),
                            cache=CacheConfig(page_size=16, pool_tokens=pool, kv_dtype=kv_dtype),
                            scheduler=SchedulerConfig(max_num_batched_tokens=budget)), ck)
    assert e.arithmetic.name == ("fast/int8" if arithmetic == "fast" else "exact/native")
    return e


def _run(e: Engine, prompts: list[list[int]], new: int = 24) -> list[list[int]]:
    outs = api.LLM.from_engine(e).generate(prompts, api.SamplingParams(max_tokens=new, temperature=0.0,
                                                                       ignore_eos=True))
    e.allocator.check_integrity()
    assert e.allocator.num_free == e.pool.num_pages
    return [o.outputs[0].token_ids for o in outs]


def _chats(ck: Checkpoint, *questions: str) -> list[list[int]]:
    tok = ck.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
            for q in questions]


def _random_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, 20000, (int(torch.randint(5, 300, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_a_request_gets_the_same_tokens_alone_and_under_load(smol: Checkpoint) -> None:
    prompts = _random_prompts(6, seed=1) + _chats(smol, "What is the capital of France?")
    alone = [_run(_engine(smol, budget=512), [p])[0] for p in prompts]
    together_big = _run(_engine(smol, budget=512), prompts)
    together_small = _run(_engine(smol, budget=48), list(reversed(prompts)))  # other chunks, other neighbours
    assert together_big == alone
    assert list(reversed(together_small)) == alone


def test_the_one_call_step_is_bit_identical_to_the_op_by_op_path(smol: Checkpoint,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real = ops.forward_fast

    def counted(*args: object, **kw: object) -> None:
        calls["n"] += 1
        real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ops, "forward_fast", counted)
    fused, plain = _engine(smol, budget=64), _engine(smol, budget=64)
    plain.model._c_fast = None
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for e in (fused, plain):
        for i, ids in enumerate(_random_prompts(3, seed=2)):
            e.add_request(GenerateRequest(f"r{i}", ids, params))
    steps = 0
    while fused.has_work() or plain.has_work():
        a, b = fused.step(), plain.step()
        steps += 1
        assert [(d.request_id, d.token_ids) for d in a] == [(d.request_id, d.token_ids) for d in b]
        assert torch.equal(fused.pool.k, plain.pool.k) and torch.equal(fused.pool.v, plain.pool.v)
    assert calls["n"] == steps  # every step went through the one call


def test_fast_answers_like_exact_on_plain_questions(smol: Checkpoint) -> None:
    prompts = _chats(smol, "What is the capital of France? Answer in one sentence.", "What is 2 + 2?")
    fast = _run(_engine(smol), prompts, new=12)
    exact = _run(_engine(smol, arithmetic="exact"), prompts, new=12)
    text = [smol.tokenizer.decode(t) for t in fast]
    assert "Paris" in text[0] and "4" in text[1], text
    assert fast[0][:6] == exact[0][:6]


def test_bfloat16_kv_halves_the_pool_answers_alike_and_scrubs(smol: Checkpoint) -> None:
    f32, bf16 = _engine(smol, kv_dtype="float32"), _engine(smol)  # auto: bfloat16 under the fast arithmetic
    assert bf16.pool.bytes_per_token * 2 == f32.pool.bytes_per_token
    assert bf16.info()["kv_dtype"] == "bfloat16" and bf16.pool.k.dtype == torch.bfloat16
    prompts = _chats(smol, "What is the capital of France? Answer in one sentence.")
    a, b = _run(f32, prompts, new=10), _run(bf16, prompts, new=10)
    assert "Paris" in smol.tokenizer.decode(b[0])
    assert a[0][:6] == b[0][:6]
    cached = set(bf16.allocator.cached_pages())  # full prompt pages stay in the prefix cache, read-only
    freed = [p for p in range(bf16.pool.num_pages) if p not in cached]
    assert cached and not bool(bf16.pool.k[:, freed].any()) and not bool(bf16.pool.v[:, freed].any())  # zeroed
    bf16.prefix_cache.clear()
    assert not bool(bf16.pool.k.any()) and not bool(bf16.pool.v.any())  # every evicted page was zeroed too


def test_a_bad_span_is_refused_before_any_kv_is_written(smol: Checkpoint) -> None:
    e = _engine(smol, pool=256)  # 16 pages
    model, arch = e.model, smol.arch
    ids = torch.tensor([1000, 1001, 1002])
    pos = torch.arange(3)
    h0 = model.embed.rows(ids) if isinstance(model.embed, ops.PackedWeight) else model.embed[ids]
    k0, v0 = e.pool.k.clone(), e.pool.v.clone()
    dims = (arch.hidden_size, arch.intermediate_size, arch.num_heads, arch.num_kv_heads, arch.head_dim)

    def call(slots: list[int], table: list[int], positions: torch.Tensor = pos) -> None:
        assert model._c_fast is not None
        ops.forward_fast(model._c_fast, dims, arch.rms_eps, model.scale, model.cos, model.sin, e.pool.k, e.pool.v,
                         h0.clone(), positions, torch.tensor(slots), torch.tensor([[0, 3, 0, 0, len(table)]]),
                         torch.tensor(table))

    for slots, table in (([0, 1, 2], [16]),      # a page past the pool
                         ([48, 49, 50], [2]),    # slots that are not the span's own page (page 3 vs 2)
                         ([32, 33, 34], [-1])):  # a negative page id
        with pytest.raises(RuntimeError, match="code -3"):
            call(slots, table)
    with pytest.raises(RuntimeError, match="code -3"):
        call([32, 33, 34], [2], positions=torch.tensor([0, 1, 5]))  # a position that is not the row's
    assert torch.equal(e.pool.k, k0) and torch.equal(e.pool.v, v0)
    call([32, 33, 34], [2])  # the same call, consistent: it writes page 2 only
    changed = (e.pool.k != k0).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
    assert changed == [2]

"""Seal 10 at its smallest: kvseal's rotary embedding (model/rope.py, the torch kernels' path) equals transformers'
own LlamaRotaryEmbedding + apply_rotary_pos_emb, bit for bit in fp32, with and without rope scaling. The whole-model
comparison (tests/e2e/test_correctness.py) needs the real model and minutes; this catches a rotation slip in a
second (the tiny random models of test_hf_tiny keep their greedy tokens under one)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvseal.model.rope import apply_rope, cos_sin_table

from .conftest import tiny_checkpoint


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_equals_transformers(scaling: dict | None) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    arch = dataclasses.replace(tiny_checkpoint().arch, head_dim=16, num_heads=2, hidden_size=32,
                               rope_theta=500000.0, rope_scaling=tuple(scaling.items()) if scaling else None)
    cfg = LlamaConfig(hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads, head_dim=arch.head_dim,
                      rope_theta=arch.rope_theta, max_position_embeddings=512, rope_scaling=scaling)
    positions = torch.tensor([0, 1, 7, 63, 64, 200, 511])
    g = torch.Generator().manual_seed(5)
    q = torch.randn(len(positions), arch.num_heads, arch.head_dim, generator=g)
    k = torch.randn(len(positions), 1, arch.head_dim, generator=g)
    cos, sin = cos_sin_table(arch, 512)
    ours_q, ours_k = apply_rope(q, cos[positions], sin[positions]), apply_rope(k, cos[positions], sin[positions])
    hf_cos, hf_sin = LlamaRotaryEmbedding(cfg)(q, positions[None])  # (1, T, D)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1)) and torch.equal(ours_k, hf_k[0].transpose(0, 1))

"""The Hugging Face weight layout a Checkpoint promises (see checkpoint.Checkpoint), and its check."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvseal.model.arch import ModelArch


def expected_weight_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every weight a Checkpoint of this arch must hold, with its HF shape."""
    h, d = arch.hidden_size, arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not arch.tie_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (arch.num_heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (arch.num_kv_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (arch.num_kv_heads * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, arch.num_heads * d)
        if arch.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (arch.num_heads * d,)
            shapes[p + "self_attn.k_proj.bias"] = (arch.num_kv_heads * d,)
            shapes[p + "self_attn.v_proj.bias"] = (arch.num_kv_heads * d,)
        if arch.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if arch.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (arch.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (arch.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, arch.intermediate_size)
    return shapes


def check_weights(weights: Mapping[str, Any], arch: ModelArch, source: str) -> None:
    """ValueError naming the first missing, unexpected or mis-shaped weight (tensors or QuantTensors)."""
    expected = expected_weight_shapes(arch)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{source}: weights do not match the architecture: missing {missing[:5]} "
            f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)} in all)"
        )
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{source}: weight {name} has shape {tuple(weights[name].shape)}, expected {shape}")

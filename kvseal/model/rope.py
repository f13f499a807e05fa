"""Rotary position embeddings, computed as Hugging Face computes them (so fp32 results match bit for bit)."""

from __future__ import annotations

import math

import torch

from kvseal.model.checkpoint import ModelArch


def inv_frequencies(arch: ModelArch) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies, with the checkpoint's rope scaling applied."""
    dim = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(arch.rope_scaling or ())
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def cos_sin_table(arch: ModelArch, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape (max_positions, head_dim), float32, indexed by absolute position."""
    inv = inv_frequencies(arch)
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    # (P, 1) @ (1, D/2): one multiply per element, the same rounding as HF's batched matmul.
    freqs = pos[:, None] @ inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, head_dim); cos/sin: (T, head_dim) already gathered by position and cast to x.dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]

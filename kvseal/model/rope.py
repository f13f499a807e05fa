"""Rotary position embeddings, computed as Hugging Face computes them (so fp32 results match bit for bit)."""

from __future__ import annotations

import math

import torch

from kvseal.model.arch import ModelArch


def inv_frequencies(arch: ModelArch, local: bool = False) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies, with the checkpoint's rope scaling applied; local: those of the
    sliding-window layers where they have their own base (Gemma 3: arch.local_rope_theta, never scaled)."""
    dim = arch.head_dim
    theta = arch.local_rope_theta if local and arch.local_rope_theta is not None else arch.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = {} if local and arch.local_rope_theta is not None else dict(arch.rope_scaling or ())
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "freq_factors":  # a GGUF's rope_freqs tensor, one divisor per frequency (llama.cpp's rope)
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors, head_dim {dim} needs {inv.numel()}")
        return inv / factors
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
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3, "
                     "freq_factors)")


def cos_sin_table(arch: ModelArch, max_positions: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape (max_positions, head_dim), float32, indexed by absolute position."""
    inv = inv_frequencies(arch, local)
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

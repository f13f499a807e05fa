"""What a model family is: the shapes and the extras each adds to a Llama layer (ModelArch). It imports nothing of
kvseal's: the KV pool and the loaders read it, and the kernels ask for its shapes (kernels/build.ArchShape)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MLP_ACTS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class ModelArch:
    """Architecture hyper-parameters of a Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2/3, Gemma 3).

    The fields after rope_scaling default to plain Llama; each names the one thing a family does differently.
    """

    family: str  # "llama" (also Mistral) | "qwen2" | "qwen3" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int  # the model's own context window
    tie_embeddings: bool
    attention_bias: bool  # Qwen2: q/k/v projections carry a bias
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # HF rope_scaling dict as sorted items
    # Qwen3, Gemma 3: an RMSNorm (weights self_attn.{q,k}_norm, (head_dim,)) over each q and k head before rope
    qk_norm: bool = False
    # per layer: its sliding window in tokens (a query sees its own position and the window - 1 before it), 0 for
    # full attention; () when every layer is full. Mistral: one window for all; Gemma 3: local and global layers.
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # Gemma 3: the windowed layers' rope base (default rope, no scaling)
    # Gemma 3: post-attention and post-feed-forward norms around each block (weights
    # post_attention_layernorm (after attention), pre_feedforward_layernorm, post_feedforward_layernorm)
    sandwich_norms: bool = False
    mlp_act: str = "silu"  # the gate's activation: "silu" | "gelu_tanh" (GeGLU)
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden), rounded to float32 as HF does
    attn_scalar: float | None = None  # attention scores scaled by attn_scalar**-0.5 (None: head_dim**-0.5)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)

    def __post_init__(self) -> None:
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"ModelArch.layer_windows has {len(self.layer_windows)} entries for "
                             f"{self.num_layers} layers")
        if any(w < 0 for w in self.layer_windows):
            raise ValueError(f"ModelArch.layer_windows {self.layer_windows} holds a negative window")
        if self.mlp_act not in MLP_ACTS:
            raise ValueError(f"ModelArch.mlp_act={self.mlp_act!r} is not one of {', '.join(MLP_ACTS)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelArch.{name} must be positive, got {getattr(self, name)}")

    def windows(self, served_len: int) -> tuple[int, ...]:
        """Per layer, the window that matters when at most `served_len` positions are served: 0 where the layer is
        full or its window holds every served position (then it is plain causal attention)."""
        return tuple(w if 0 < w < served_len else 0 for w in self.layer_windows or (0,) * self.num_layers)

    @property
    def plain(self) -> bool:
        """Nothing beyond a Llama/Qwen2 layer but the rope tables (what the whole-model C paths compute)."""
        return not (self.qk_norm or self.local_rope_theta is not None or self.sandwich_norms
                    or self.mlp_act != "silu" or self.embed_scale is not None or self.attn_scalar is not None
                    or self.final_softcap is not None)

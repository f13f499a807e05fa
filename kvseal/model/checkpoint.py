"""What a loaded checkpoint is, independent of its file format (GGUF or Hugging Face folder)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

MLP_ACTS = ("silu", "gelu_tanh")

if TYPE_CHECKING:
    from kvseal.model.gguf_file import GGUFFile
    from kvseal.model.quant import QuantTensor
    from kvseal.model.tokenizer import Tokenizer


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


@dataclass
class Checkpoint:
    """A checkpoint loaded into memory, or mapped: quantized weights stay where the file has them.

    weights: float tensors with Hugging Face names and layouts (q/k in rotate-half order, Linear weights [out, in]),
    float32 on the CPU; the model casts them to its dtype/device:
      model.embed_tokens.weight                      (vocab, hidden)
      model.layers.{i}.input_layernorm.weight        (hidden,)
      model.layers.{i}.self_attn.{q,k,v,o}_proj.weight, q/k/v .bias when arch.attention_bias
      model.layers.{i}.post_attention_layernorm.weight
      model.layers.{i}.mlp.{gate,up,down}_proj.weight
      model.layers.{i}.self_attn.{q,k}_norm.weight   (head_dim,) when arch.qk_norm
      model.layers.{i}.{pre,post}_feedforward_layernorm.weight   when arch.sandwich_norms
      model.norm.weight
    Every norm weight is the multiplier itself: Gemma's (1 + w) is folded in at load (as llama.cpp's converter
    stores it), computed in float32 as transformers computes it.
      lm_head.weight                                 absent when arch.tie_embeddings
    packed: the weights a GGUF file stores in GGML blocks (and in float types the kernels take as stored), under
    the same names and HF shapes, as QuantTensor views of the mapped file; a name is in `weights` or in `packed`,
    never both. No float32 copy of a packed weight exists; model/weights.py turns them into what an arithmetic
    multiplies by.
    content_key: the file's content hash (model/file_index.py), naming its weights cache; "" when there is no
    file to key by (a Hugging Face folder, an in-memory model): derived weights then stay in memory.
    mapped: the open GGUF file the views point into (None when nothing is mapped).
    """

    arch: ModelArch
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    name: str  # a display name (e.g. "SmolLM2-135M-Instruct")
    source: str  # the path it was loaded from
    fingerprint: str = field(default="")
    packed: dict[str, QuantTensor] = field(default_factory=dict)
    content_key: str = ""
    mapped: GGUFFile | None = None

    def __post_init__(self) -> None:
        both = set(self.weights) & set(self.packed)
        if both:
            raise ValueError(f"weights {sorted(both)[:3]} are both float and packed")
        if not self.fingerprint:
            self.fingerprint = weights_fingerprint(self.weights)

    def block_types(self) -> dict[int, str]:
        """The GGML types of the packed weights: id -> name (e.g. {12: "Q4_K", 14: "Q6_K"})."""
        return {q.qtype: q.type_name for q in self.packed.values()}

    def release(self, q: QuantTensor) -> None:
        """Drop this process's pages of a packed weight's bytes (after a one-time pass; a later read maps them)."""
        if self.mapped is not None and q.offset >= 0:
            self.mapped.release(q.offset, q.nbytes)


def weights_fingerprint(weights: dict[str, torch.Tensor]) -> str:
    """A stable hash of the weights: names, shapes, dtypes and every byte, in sorted name order.

    Two workers that agree on this hash compute the same KV for the same tokens (seal 7).
    """
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(str(t.dtype).encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return "sha256:" + h.hexdigest()[:32]

"""What a loaded checkpoint is, independent of its file format (GGUF or Hugging Face folder)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvseal.model.arch import ModelArch

if TYPE_CHECKING:
    from kvseal.model.gguf_file import GGUFFile
    from kvseal.model.quant import QuantTensor
    from kvseal.model.tokenizer import Tokenizer


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

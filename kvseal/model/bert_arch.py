"""A BERT encoder's shape, from its Hugging Face config.json (no torch: the router reads it to know the model it
serves embeddings for; model/bert.py computes with it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BertArch:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position: int
    type_vocab_size: int
    eps: float

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str) -> BertArch:
        if cfg.get("model_type") != "bert":
            raise ValueError(f"{source}: model_type {cfg.get('model_type')!r} is not an encoder kvseal can embed "
                             f"with; serve a BERT checkpoint (a sentence-transformers folder)")
        if cfg.get("hidden_act", "gelu") != "gelu" or cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{source}: hidden_act {cfg.get('hidden_act')!r} / position_embedding_type "
                             f"{cfg.get('position_embedding_type')!r}: kvseal's BERT has gelu and absolute positions")
        arch = cls(int(cfg["vocab_size"]), int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]),
                   int(cfg["num_attention_heads"]), int(cfg["intermediate_size"]),
                   int(cfg["max_position_embeddings"]), int(cfg.get("type_vocab_size", 2)),
                   float(cfg.get("layer_norm_eps", 1e-12)))
        if arch.hidden_size % arch.num_heads:
            raise ValueError(f"{source}: hidden_size {arch.hidden_size} is not a multiple of num_attention_heads "
                             f"{arch.num_heads}")
        return arch

"""A BERT encoder (BertModel, as in sentence-transformers checkpoints) in float32, over packed sequences.

The batch is one (T, H) tensor of every input's tokens back to back (no padding): the projections and the MLP,
nearly all of the work, run on real tokens only. Attention alone takes each input apart, on its own rows (a slice
of the batch: no padding and no mask; measured faster on CPU than padded grids of inputs of close lengths).

Equal to transformers' BertModel up to float32 rounding order (tests/e2e/test_embeddings.py compares the pooled
embeddings with sentence-transformers').
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvseal.model.bert_arch import BertArch


@dataclass(frozen=True)
class Layer:
    qkv_w: torch.Tensor  # (3H, H): query, key and value stacked, one matmul
    qkv_b: torch.Tensor  # (3H,)
    out_w: torch.Tensor  # (H, H)
    out_b: torch.Tensor
    ln1: tuple[torch.Tensor, torch.Tensor]  # attention.output.LayerNorm (weight, bias)
    up_w: torch.Tensor  # (I, H)
    up_b: torch.Tensor
    down_w: torch.Tensor  # (H, I)
    down_b: torch.Tensor
    ln2: tuple[torch.Tensor, torch.Tensor]  # output.LayerNorm


class BertEncoder:
    """Token ids of several inputs -> each token's last hidden state, packed (T, H)."""

    def __init__(self, arch: BertArch, weights: dict[str, torch.Tensor]) -> None:
        self.arch = arch

        def w(name: str) -> torch.Tensor:
            t = weights.get(name, weights.get("bert." + name))  # some checkpoints keep BertForX's prefix
            if t is None:
                raise ValueError(f"the checkpoint has no weight {name!r}")
            return t.to(torch.float32).contiguous()

        self.word, self.position = w("embeddings.word_embeddings.weight"), w("embeddings.position_embeddings.weight")
        self.type0 = w("embeddings.token_type_embeddings.weight")[0]  # every input is one segment
        self.ln0 = (w("embeddings.LayerNorm.weight"), w("embeddings.LayerNorm.bias"))
        self.layers: list[Layer] = []
        for i in range(arch.num_layers):
            p = f"encoder.layer.{i}."
            a = p + "attention.self."
            self.layers.append(Layer(
                torch.cat([w(a + "query.weight"), w(a + "key.weight"), w(a + "value.weight")]).contiguous(),
                torch.cat([w(a + "query.bias"), w(a + "key.bias"), w(a + "value.bias")]),
                w(p + "attention.output.dense.weight"), w(p + "attention.output.dense.bias"),
                (w(p + "attention.output.LayerNorm.weight"), w(p + "attention.output.LayerNorm.bias")),
                w(p + "intermediate.dense.weight"), w(p + "intermediate.dense.bias"),
                w(p + "output.dense.weight"), w(p + "output.dense.bias"),
                (w(p + "output.LayerNorm.weight"), w(p + "output.LayerNorm.bias"))))

    @torch.inference_mode()
    def forward(self, ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden (T, H), lengths (B,)) for B inputs of T tokens in all, packed in the order given; each input is
        1..max_position tokens."""
        a = self.arch
        lengths = torch.tensor([len(x) for x in ids], dtype=torch.long)
        flat = torch.tensor([t for x in ids for t in x], dtype=torch.long)
        T, H = int(flat.numel()), a.hidden_size
        pos = torch.cat([torch.arange(n) for n in lengths.tolist()])  # (T,)
        spans = list(zip((torch.cumsum(lengths, 0) - lengths).tolist(), lengths.tolist()))  # each input's rows
        x = F.layer_norm(self.word[flat] + self.position[pos] + self.type0, (H,), *self.ln0, a.eps)
        att = torch.empty(T, H)
        for layer in self.layers:
            qkv = torch.addmm(layer.qkv_b, x, layer.qkv_w.t())  # (T, 3H)
            for start, n in spans:  # attention within each input: its own rows, no padding, no mask
                attend(qkv[start:start + n], a.num_heads, att[start:start + n])
            x = F.layer_norm(torch.addmm(layer.out_b, att, layer.out_w.t()) + x, (H,), *layer.ln1, a.eps)
            up = F.gelu(torch.addmm(layer.up_b, x, layer.up_w.t()))  # (T, I); gelu: erf, as BERT's
            x = F.layer_norm(torch.addmm(layer.down_b, up, layer.down_w.t()) + x, (H,), *layer.ln2, a.eps)
        return x, lengths


def attend(qkv: torch.Tensor, heads: int, out: torch.Tensor) -> None:
    """(n, 3H) one input's query, key and value rows -> its attention outputs written into `out` (n, H); every
    token sees every token of its input."""
    n, H = out.shape
    q, k, v = qkv.view(n, 3, heads, H // heads).permute(1, 2, 0, 3).contiguous()  # each (heads, n, hd)
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=1.0 / math.sqrt(H // heads))
    out.view(n, heads, H // heads).copy_(o[0].transpose(0, 1))  # one copy, straight into the packed rows

"""The Llama-family decoder (Llama, SmolLM, Qwen2) with a paged KV cache.

Shapes: T = tokens in the flattened batch, H = query heads, KVH = kv heads, D = head_dim, E = hidden.
Numerics follow Hugging Face's LlamaForCausalLM so fp32 greedy output matches it token for token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvseal.model.attention import AttentionMeta, paged_attention
from kvseal.model.checkpoint import Checkpoint, ModelArch
from kvseal.model.rope import apply_rope, cos_sin_table


class _Layer:
    """One decoder layer's weights. q/k/v and gate/up are stored fused, so a layer is four matrix products:
    wqkv (H*D + 2*KVH*D, E), wo (E, H*D), w_gate_up (2*I, E), w_down (E, I)."""

    __slots__ = ("bqkv", "ln1", "ln2", "w_down", "w_gate_up", "wo", "wqkv")

    def __init__(self, w: dict[str, torch.Tensor], i: int, arch: ModelArch) -> None:
        p = f"model.layers.{i}."
        self.ln1 = w[p + "input_layernorm.weight"]
        qkv = [p + f"self_attn.{x}_proj" for x in "qkv"]
        self.wqkv = torch.cat([w[n + ".weight"] for n in qkv])
        self.bqkv = torch.cat([w[n + ".bias"] for n in qkv]) if arch.attention_bias else None
        self.wo = w[p + "self_attn.o_proj.weight"]
        self.ln2 = w[p + "post_attention_layernorm.weight"]
        self.w_gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        self.w_down = w[p + "mlp.down_proj.weight"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class LlamaModel:
    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device) -> None:
        self.arch = arch = ckpt.arch
        self.dtype, self.device = dtype, device
        w = {name: t.to(device=device, dtype=dtype) for name, t in ckpt.weights.items()}
        self.embed = w["model.embed_tokens.weight"]  # (V, E)
        self.lm_head = self.embed if arch.tie_embeddings else w["lm_head.weight"]
        self.norm = w["model.norm.weight"]
        self.layers = [_Layer(w, i, arch) for i in range(arch.num_layers)]
        cos, sin = cos_sin_table(arch, arch.max_position)
        self.cos, self.sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
        self.scale = arch.head_dim**-0.5

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) int64
        positions: torch.Tensor,  # (T,) int64 absolute positions
        k_cache: torch.Tensor,  # (L, P, S, KVH, D)
        v_cache: torch.Tensor,
        meta: AttentionMeta,
        logits_rows: torch.Tensor,  # (B,) int64 rows whose next-token logits are wanted
    ) -> torch.Tensor:  # (B, V) float32 logits
        a = self.arch
        t = input_ids.shape[0]
        kvd = a.num_kv_heads * a.head_dim
        h = F.embedding(input_ids, self.embed)  # (T, E)
        cos, sin = self.cos[positions], self.sin[positions]  # (T, D)
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.ln1, a.rms_eps)
            qkv = F.linear(x, layer.wqkv, layer.bqkv)  # (T, (H + 2 * KVH) * D)
            q, k, v = qkv.split([a.num_heads * a.head_dim, kvd, kvd], dim=-1)
            q = apply_rope(q.view(t, a.num_heads, a.head_dim), cos, sin)
            k = apply_rope(k.view(t, a.num_kv_heads, a.head_dim), cos, sin)
            o = paged_attention(q, k, v.view(t, a.num_kv_heads, a.head_dim), k_cache[i], v_cache[i], meta)
            h = h + F.linear(o.reshape(t, a.num_heads * a.head_dim), layer.wo)
            x = rms_norm(h, layer.ln2, a.rms_eps)
            gate, up = F.linear(x, layer.w_gate_up).chunk(2, dim=-1)  # (T, I) each
            h = h + F.linear(F.silu(gate) * up, layer.w_down)
        h = rms_norm(h[logits_rows], self.norm, a.rms_eps)
        return F.linear(h, self.lm_head).float()

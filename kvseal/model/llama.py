"""The Llama-family decoder (Llama, SmolLM, Qwen2) with a paged KV cache.

Shapes: T = tokens in the flattened batch, H = query heads, KVH = kv heads, D = head_dim, E = hidden.
Numerics follow Hugging Face's LlamaForCausalLM so fp32 greedy output matches it token for token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvseal.kernels import ops
from kvseal.kernels.ops import PackedWeight, concat_rows, packed_linear
from kvseal.model.attention import AttentionMeta, paged_attention
from kvseal.model.checkpoint import Checkpoint, ModelArch
from kvseal.model.rope import apply_rope, cos_sin_table

Weight = torch.Tensor | PackedWeight  # a dense (N, K) tensor, or GGUF blocks for the native kernels


class _Weights:
    """Hands out each weight dense, or packed when the native kernels run and the file stored it packed."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, native: bool) -> None:
        self.ckpt, self.dtype, self.device, self.native = ckpt, dtype, device, native

    def dense(self, name: str) -> torch.Tensor:
        return self.ckpt.weights[name].to(device=self.device, dtype=self.dtype)

    def get(self, *names: str) -> Weight:
        """One weight, or several fused along their rows (output features)."""
        if self.native and all(n in self.ckpt.packed for n in names):
            parts = [self.ckpt.packed[n] for n in names]
            if len({(p.qtype, p.k) for p in parts}) == 1:
                return parts[0] if len(parts) == 1 else concat_rows(parts)
        return self.dense(names[0]) if len(names) == 1 else torch.cat([self.dense(n) for n in names])


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, PackedWeight):
        return packed_linear(x, w, bias)
    return F.linear(x, w, bias)


class _Layer:
    """One decoder layer's weights. q/k/v and gate/up are stored fused, so a layer is four matrix products:
    wqkv (H*D + 2*KVH*D, E), wo (E, H*D), w_gate_up (2*I, E), w_down (E, I)."""

    __slots__ = ("bqkv", "ln1", "ln2", "w_down", "w_gate_up", "wo", "wqkv")

    def __init__(self, w: _Weights, i: int, arch: ModelArch) -> None:
        p = f"model.layers.{i}."
        self.ln1 = w.dense(p + "input_layernorm.weight")
        qkv = [p + f"self_attn.{x}_proj" for x in "qkv"]
        self.wqkv = w.get(*(n + ".weight" for n in qkv))
        self.bqkv = torch.cat([w.dense(n + ".bias") for n in qkv]) if arch.attention_bias else None
        self.wo = w.get(p + "self_attn.o_proj.weight")
        self.ln2 = w.dense(p + "post_attention_layernorm.weight")
        self.w_gate_up = w.get(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        self.w_down = w.get(p + "mlp.down_proj.weight")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class LlamaModel:
    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, native: bool = False) -> None:
        """native: run kvseal's C kernels (packed GGUF weights where the file has them, paged decode
        attention); the caller has checked they can run here (kvseal.kernels.build.resolve)."""
        self.arch = arch = ckpt.arch
        self.dtype, self.device, self.native = dtype, device, native
        w = _Weights(ckpt, dtype, device, native)
        self.embed = w.get("model.embed_tokens.weight")  # (V, E)
        self.lm_head = self.embed if arch.tie_embeddings else w.get("lm_head.weight")
        self.norm = w.dense("model.norm.weight")
        self.layers = [_Layer(w, i, arch) for i in range(arch.num_layers)]
        cos, sin = cos_sin_table(arch, arch.max_position)
        self.cos, self.sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
        self.scale = arch.head_dim**-0.5
        # Decode-only steps run every layer in one C call when all four matrices of every layer are packed.
        self._c_layers = None
        packed = [(ly.wqkv, ly.wo, ly.w_gate_up, ly.w_down, ly.bqkv, ly.ln1, ly.ln2) for ly in self.layers
                  if isinstance(ly.wqkv, PackedWeight) and isinstance(ly.wo, PackedWeight)
                  and isinstance(ly.w_gate_up, PackedWeight) and isinstance(ly.w_down, PackedWeight)]
        if native and len(packed) == len(self.layers):
            self._c_layers = ops.layer_table(packed)

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
        if isinstance(self.embed, PackedWeight):
            h = self.embed.rows(input_ids)  # (T, E)
        else:
            h = F.embedding(input_ids, self.embed)  # (T, E)
        if (self._c_layers is not None and not meta.prefills and meta.decode_rows is not None
                and meta.decode_rows.shape[0] == t and t < ops.DENSE_FROM_ROWS):
            # every row is one decode token, rows in order (the runner's layout for a decode-only batch): all
            # layers in one C call, the same ops in the same order as the loop below
            assert meta.decode_pages is not None and meta.decode_kv_lens is not None
            ops.decode_forward(self._c_layers, (a.hidden_size, a.intermediate_size, a.num_heads, a.num_kv_heads,
                               a.head_dim, k_cache.shape[2]), a.rms_eps, self.scale, self.cos, self.sin, k_cache,
                               v_cache, h, positions, meta.slot_mapping, meta.decode_pages, meta.decode_kv_lens)
        else:
            rotate = self._rotary(positions)
            hd = a.num_heads * a.head_dim
            for i, layer in enumerate(self.layers):
                x = self._norm(h, layer.ln1)
                q, k, v = rotate(linear(x, layer.wqkv, layer.bqkv))  # (T, H, D), (T, KVH, D), (T, KVH, D)
                o = paged_attention(q, k, v, k_cache[i], v_cache[i], meta, self.scale, self.native)
                h = h + linear(o.reshape(t, hd), layer.wo)
                x = self._norm(h, layer.ln2)
                h = h + linear(self._swiglu(linear(x, layer.w_gate_up)), layer.w_down)
        return linear(self._norm(h[logits_rows], self.norm), self.lm_head).float()

    # The three places where the kernel sets differ; native is the same math with sums in another order.
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, weight, self.arch.rms_eps) if self.native else rms_norm(x, weight, self.arch.rms_eps)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
        if self.native:
            return ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _rotary(self, positions: torch.Tensor) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
        """qkv (T, (H + 2 KVH) * D) -> q, k rotated by RoPE at `positions`, and v, as (T, heads, D) views."""
        a = self.arch
        sizes = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]

        def heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
            t = q.shape[0]
            return (q.view(t, a.num_heads, a.head_dim), k.view(t, a.num_kv_heads, a.head_dim),
                    v.view(t, a.num_kv_heads, a.head_dim))

        if self.native:  # in place on the fused rows, q and k heads in one call

            def rotate_native(qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
                ops.rope_(qkv, a.num_heads + a.num_kv_heads, a.head_dim, self.cos, self.sin, positions)
                return heads(*qkv.split(sizes, dim=-1))

            return rotate_native
        cos, sin = self.cos[positions], self.sin[positions]  # (T, D)

        def rotate_torch(qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
            q, k, v = heads(*qkv.split(sizes, dim=-1))
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

        return rotate_torch

"""The Llama-family decoder (Llama, SmolLM, Qwen2) with a paged KV cache.

Shapes: T = tokens in the flattened batch, H = query heads, KVH = kv heads, D = head_dim, E = hidden.
Numerics follow Hugging Face's LlamaForCausalLM so fp32 greedy output matches it token for token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvseal.kernels import ops
from kvseal.kernels.ops import FusedRows, PackedWeight, QWeight
from kvseal.model.attention import AttentionMeta, paged_attention
from kvseal.model.checkpoint import Checkpoint, ModelArch
from kvseal.model.rope import apply_rope, cos_sin_table
from kvseal.model.weights import Embedding, ModelWeights, linear


class _Layer:
    """One decoder layer's weights. q/k/v and gate/up are stored fused, so a layer is four matrix products:
    wqkv (H*D + 2*KVH*D, E), wo (E, H*D), w_gate_up (2*I, E), w_down (E, I)."""

    __slots__ = ("bqkv", "ln1", "ln2", "w_down", "w_gate_up", "wo", "wqkv")

    def __init__(self, w: ModelWeights, i: int, arch: ModelArch) -> None:
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
    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, native: bool = False,
                 fast: bool = False, progress: bool = True) -> None:
        """native: run kvseal's C kernels (packed GGUF weights where the file has them, paged decode
        attention); the caller has checked they can run here (kvseal.kernels.build.resolve).
        fast: the fast arithmetic (kvseal/kernels/arithmetic.py; needs native): int8 matrix products on
        repacked blocks, attention over a "kt" pool (kvseal/kv/pool.py)."""
        self.arch = arch = ckpt.arch
        self.dtype, self.device, self.native, self.fast = dtype, device, native, fast
        # (V, E) dense, GGUF blocks or the file's quantized rows: only rows are looked up
        self.embed: Embedding
        with ModelWeights(ckpt, dtype, device, native, fast, progress) as w:
            self.embed = w.embedding("model.embed_tokens.weight")
            self.lm_head = w.get("lm_head.weight" if not arch.tie_embeddings else "model.embed_tokens.weight")
            self.norm = w.dense("model.norm.weight")
            self.layers = [_Layer(w, i, arch) for i in range(arch.num_layers)]
        # the file its derived weights are in (None: nothing derived, or kept in memory)
        self.weights_cache = w.cache.path if w.cache is not None and w.cache.in_use else None
        self.weights_cache_built = w.cache is not None and w.cache.built  # this process wrote it
        cos, sin = cos_sin_table(arch, arch.max_position)
        self.cos, self.sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
        self.scale = arch.head_dim**-0.5
        # Decode-only steps run every layer in one C call when all four matrices of every layer are packed.
        self._c_layers = None
        packed = []
        for ly in self.layers:
            q, o, gu, down = ly.wqkv, ly.wo, ly.w_gate_up, ly.w_down
            if (isinstance(q, PackedWeight | FusedRows) and isinstance(o, PackedWeight | FusedRows)
                    and isinstance(gu, PackedWeight | FusedRows) and isinstance(down, PackedWeight | FusedRows)):
                packed.append((q, o, gu, down, ly.bqkv, ly.ln1, ly.ln2))
        if native and len(packed) == len(self.layers):
            self._c_layers = ops.layer_table(packed)
        # The fast arithmetic runs every step's layers in one C call (forward.c); None: op by op (tests compare).
        self._c_fast = None
        qs = [(ly.wqkv, ly.wo, ly.w_gate_up, ly.w_down, ly.bqkv, ly.ln1, ly.ln2) for ly in self.layers]
        if fast and all(isinstance(w, QWeight) for q in qs for w in q[:4]):  # not when a weight is Dequantized
            self._c_fast = ops.layer_table(qs)  # type: ignore[arg-type]  # Weight narrowed by the check above

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
        if isinstance(self.embed, torch.Tensor):
            h = F.embedding(input_ids, self.embed)  # (T, E)
        else:
            h = self.embed.rows(input_ids.cpu()).to(device=self.device, dtype=self.dtype)  # (T, E)
        if self.fast and self._c_fast is not None:
            assert meta.spans is not None and meta.tables is not None
            ops.forward_fast(self._c_fast, (a.hidden_size, a.intermediate_size, a.num_heads, a.num_kv_heads,
                             a.head_dim), a.rms_eps, self.scale, self.cos, self.sin, k_cache, v_cache, h, positions,
                             meta.slot_mapping, meta.spans, meta.tables)
        elif self.fast:
            h = self._layers_fast(h, positions, k_cache, v_cache, meta)
        elif (self._c_layers is not None and not meta.prefills and meta.decode_rows is not None
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

    def _layers_fast(self, h: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMeta) -> torch.Tensor:
        """Every layer with the fast arithmetic; k_cache (L, P, KVH, D, S), v_cache (L, P, S, KVH, D)."""
        a = self.arch
        assert meta.spans is not None and meta.tables is not None
        t, hd, kd = h.shape[0], a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        for i, layer in enumerate(self.layers):
            x = ops.rms_norm(h, layer.ln1, a.rms_eps)
            qkv = linear(x, layer.wqkv, layer.bqkv)  # (T, HD + 2 KD)
            ops.rope_(qkv, a.num_heads + a.num_kv_heads, a.head_dim, self.cos, self.sin, positions)
            ops.write_kv(qkv[:, hd : hd + kd].reshape(t, a.num_kv_heads, a.head_dim),
                         qkv[:, hd + kd :].reshape(t, a.num_kv_heads, a.head_dim), k_cache[i], v_cache[i],
                         meta.slot_mapping)
            o = ops.paged_attention_kt(qkv[:, :hd].reshape(t, a.num_heads, a.head_dim), k_cache[i], v_cache[i],
                                       meta.spans, meta.tables, self.scale)
            h = h + linear(o.view(t, hd), layer.wo)
            x = ops.rms_norm(h, layer.ln2, a.rms_eps)
            h = h + linear(ops.silu_mul(linear(x, layer.w_gate_up)), layer.w_down)
        return h

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

"""The Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2/3, Gemma 3) with a paged KV cache.

Shapes: T = tokens in the flattened batch, H = query heads, KVH = kv heads, D = head_dim, E = hidden.
Numerics follow Hugging Face's LlamaForCausalLM (Qwen3ForCausalLM, Gemma3ForCausalLM) so fp32 greedy output matches
it token for token. What a family adds to a Llama layer is in ModelArch: q/k norms (Qwen3, Gemma 3), sliding
windows (Mistral, Gemma 3's local layers, with their own rope base), sandwich norms, GeGLU, scaled embeddings, the
query scale and the final logit softcap (Gemma 3). Those run on the layer-by-layer paths (exact: torch or native ops;
fast: _layers_fast); the whole-model C calls (decode_forward, forward_fast) compute a plain Llama/Qwen2 layer and are
used only for those. With its sliding layers' KV in a pool of their own (kv/window.py) a step gets per-layer caches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvseal.kernels import ops
from kvseal.kernels.weights import FusedRows, PackedWeight, QWeight
from kvseal.model.arch import ModelArch
from kvseal.model.attention import AttentionMeta, paged_attention, window_attention_kt
from kvseal.model.checkpoint import Checkpoint
from kvseal.model.rope import apply_rope, cos_sin_table
from kvseal.model.weights import Embedding, ModelWeights, linear


class _Layer:
    """One decoder layer's weights. q/k/v and gate/up are stored fused, so a layer is four matrix products:
    wqkv (H*D + 2*KVH*D, E), wo (E, H*D), w_gate_up (2*I, E), w_down (E, I)."""

    __slots__ = ("bqkv", "k_norm", "ln1", "ln2", "post_attn", "post_ffn", "q_norm", "w_down", "w_gate_up", "wo",
                 "wqkv")

    def __init__(self, w: ModelWeights, i: int, arch: ModelArch) -> None:
        p = f"model.layers.{i}."
        self.ln1 = w.dense(p + "input_layernorm.weight")
        qkv = [p + f"self_attn.{x}_proj" for x in "qkv"]
        self.wqkv = w.get(*(n + ".weight" for n in qkv))
        self.bqkv = torch.cat([w.dense(n + ".bias") for n in qkv]) if arch.attention_bias else None
        self.wo = w.get(p + "self_attn.o_proj.weight")
        # (D,) each, over every q (k) head before rope
        self.q_norm = w.dense(p + "self_attn.q_norm.weight") if arch.qk_norm else None
        self.k_norm = w.dense(p + "self_attn.k_norm.weight") if arch.qk_norm else None
        # ln2 is the norm before the MLP; Gemma's post_attention_layernorm is the sandwich norm after attention
        self.post_attn = self.post_ffn = None
        if arch.sandwich_norms:
            self.post_attn = w.dense(p + "post_attention_layernorm.weight")
            self.ln2 = w.dense(p + "pre_feedforward_layernorm.weight")
            self.post_ffn = w.dense(p + "post_feedforward_layernorm.weight")
        else:
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
                 fast: bool = False, progress: bool = True, max_model_len: int | None = None) -> None:
        """native: run kvseal's C kernels (packed GGUF weights where the file has them, paged decode
        attention); the caller has checked they can run here (kvseal.kernels.build.resolve).
        fast: the fast arithmetic (kvseal/kernels/arithmetic.py; needs native): int8 matrix products on
        repacked blocks, attention over a "kt" pool (kvseal/kv/pool.py); the caller has checked it can run here
        (fast_blockers).
        max_model_len: the most positions served (None: the model's own window); a sliding window that holds
        them all is plain causal attention."""
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
        served = min(arch.max_position, max_model_len or arch.max_position)
        self.windows = arch.windows(served)  # per layer: 0 or a window shorter than what is served
        cos, sin = cos_sin_table(arch, served)
        self.cos, self.sin = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
        self.cos_local, self.sin_local = self.cos, self.sin  # the windowed layers' tables
        if arch.local_rope_theta is not None:
            cos, sin = cos_sin_table(arch, served, local=True)
            self.cos_local, self.sin_local = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
        self.scale = (arch.attn_scalar if arch.attn_scalar is not None else arch.head_dim) ** -0.5
        # as transformers multiplies: by a float32 scalar tensor made from the Python float
        self.embed_scale = None if arch.embed_scale is None else torch.tensor(arch.embed_scale).to(dtype)
        # Decode-only steps run every layer in one C call when all four matrices of every layer are packed (a plain
        # Llama/Qwen2 layer: the C code knows nothing else).
        plain = arch.plain and not any(self.windows)
        self._c_layers = None
        packed = []
        for ly in self.layers:
            q, o, gu, down = ly.wqkv, ly.wo, ly.w_gate_up, ly.w_down
            if (isinstance(q, PackedWeight | FusedRows) and isinstance(o, PackedWeight | FusedRows)
                    and isinstance(gu, PackedWeight | FusedRows) and isinstance(down, PackedWeight | FusedRows)):
                packed.append((q, o, gu, down, ly.bqkv, ly.ln1, ly.ln2))
        if native and plain and len(packed) == len(self.layers):
            self._c_layers = ops.layer_table(packed)
        # The fast arithmetic runs every step's layers in one C call (forward.c); None: op by op (tests compare).
        self._c_fast = None
        qs = [(ly.wqkv, ly.wo, ly.w_gate_up, ly.w_down, ly.bqkv, ly.ln1, ly.ln2) for ly in self.layers]
        # not when a weight is Dequantized
        if fast and plain and all(isinstance(w, QWeight) for q in qs for w in q[:4]):
            self._c_fast = ops.layer_table(qs)  # type: ignore[arg-type]  # Weight narrowed by the check above

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) int64
        positions: torch.Tensor,  # (T,) int64 absolute positions
        # (L, P, S, KVH, D), or per layer (P, S, KVH, D) when the sliding layers have their own pool (kv/window.py)
        k_cache: torch.Tensor | list[torch.Tensor],
        v_cache: torch.Tensor | list[torch.Tensor],
        meta: AttentionMeta,  # meta.window: the sliding layers' own tables, when they have their own pool
        logits_rows: torch.Tensor,  # (B,) int64 rows whose next-token logits are wanted
    ) -> torch.Tensor:  # (B, V) float32 logits
        a = self.arch
        t = input_ids.shape[0]
        if isinstance(self.embed, torch.Tensor):
            h = F.embedding(input_ids, self.embed)  # (T, E)
        else:
            h = self.embed.rows(input_ids.cpu()).to(device=self.device, dtype=self.dtype)  # (T, E)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        if isinstance(k_cache, list) or isinstance(v_cache, list):
            # the sliding layers have their own pool (kv/window.py): only the layer-by-layer paths read it
            assert self._c_layers is None and self._c_fast is None and meta.window is not None
            if self.fast:
                h = self._layers_fast(h, positions, k_cache, v_cache, meta)
            else:
                h = self._layers(h, positions, k_cache, v_cache, meta)
        elif self.fast and self._c_fast is not None:
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
            h = self._layers(h, positions, k_cache, v_cache, meta)
        logits = linear(self._norm(h[logits_rows], self.norm), self.lm_head).float()
        if a.final_softcap is not None:
            logits = torch.tanh(logits / a.final_softcap) * a.final_softcap
        return logits

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor | list[torch.Tensor],
                v_cache: torch.Tensor | list[torch.Tensor], meta: AttentionMeta) -> torch.Tensor:
        """Every layer, one op at a time (torch or native ops); k_cache[i], v_cache[i]: layer i's (P, S, KVH, D)."""
        a = self.arch
        t, hd = h.shape[0], a.num_heads * a.head_dim
        rotate = self._rotary(positions, self.cos, self.sin)
        rotate_local = rotate if self.cos_local is self.cos else self._rotary(positions, self.cos_local, self.sin_local)
        for i, layer in enumerate(self.layers):
            x = self._norm(h, layer.ln1)
            qkv = linear(x, layer.wqkv, layer.bqkv)  # (T, HD + 2 KD)
            if layer.q_norm is not None:
                assert layer.k_norm is not None
                qkv = self._qk_norm(qkv, layer.q_norm, layer.k_norm)
            windowed = bool(a.layer_windows) and a.layer_windows[i] > 0  # Gemma: its own rope base
            q, k, v = (rotate_local if windowed else rotate)(qkv)  # (T, H, D), (T, KVH, D), (T, KVH, D)
            m_i = meta.window if self.windows[i] and meta.window is not None else meta  # its pool's tables
            o = paged_attention(q, k, v, k_cache[i], v_cache[i], m_i, self.scale, self.native, self.windows[i])
            o = linear(o.reshape(t, hd), layer.wo)
            h = h + (o if layer.post_attn is None else self._norm(o, layer.post_attn))
            x = self._norm(h, layer.ln2)
            m = linear(self._gated(linear(x, layer.w_gate_up)), layer.w_down)
            h = h + (m if layer.post_ffn is None else self._norm(m, layer.post_ffn))
        return h

    def _layers_fast(self, h: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor | list[torch.Tensor],
                     v_cache: torch.Tensor | list[torch.Tensor], meta: AttentionMeta) -> torch.Tensor:
        """Every layer with the fast arithmetic; k_cache[i] (P, KVH, D, S), v_cache[i] (P, S, KVH, D). A family's extras
        are the exact path's native ops (q/k norms, sandwich norms, GeGLU); a sliding-window layer's attention reads
        only its window's pages, in torch (window_attention_kt): the C kernel has no window."""
        a = self.arch
        t, hd, kd = h.shape[0], a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        for i, layer in enumerate(self.layers):
            m_i = meta.window if self.windows[i] and meta.window is not None else meta  # its pool's tables
            assert m_i.spans is not None and m_i.tables is not None
            x = ops.rms_norm(h, layer.ln1, a.rms_eps)
            qkv = linear(x, layer.wqkv, layer.bqkv)  # (T, HD + 2 KD)
            if layer.q_norm is not None:
                assert layer.k_norm is not None
                qkv = self._qk_norm(qkv, layer.q_norm, layer.k_norm)
            local = bool(a.layer_windows) and a.layer_windows[i] > 0  # Gemma: its own rope base
            ops.rope_(qkv, a.num_heads + a.num_kv_heads, a.head_dim, self.cos_local if local else self.cos,
                      self.sin_local if local else self.sin, positions)
            ops.write_kv(qkv[:, hd : hd + kd].reshape(t, a.num_kv_heads, a.head_dim),
                         qkv[:, hd + kd :].reshape(t, a.num_kv_heads, a.head_dim), k_cache[i], v_cache[i],
                         m_i.slot_mapping)
            q = qkv[:, :hd].reshape(t, a.num_heads, a.head_dim)
            if self.windows[i]:
                o = window_attention_kt(q, k_cache[i], v_cache[i], m_i.spans, m_i.tables, self.scale, self.windows[i])
            else:
                o = ops.paged_attention_kt(q, k_cache[i], v_cache[i], m_i.spans, m_i.tables, self.scale)
            o = linear(o.view(t, hd), layer.wo)
            h = h + (o if layer.post_attn is None else ops.rms_norm(o, layer.post_attn, a.rms_eps))
            x = ops.rms_norm(h, layer.ln2, a.rms_eps)
            mlp = linear(self._gated(linear(x, layer.w_gate_up)), layer.w_down)
            h = h + (mlp if layer.post_ffn is None else ops.rms_norm(mlp, layer.post_ffn, a.rms_eps))
        return h

    # The three places where the kernel sets differ; native is the same math with sums in another order.
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, weight, self.arch.rms_eps) if self.native else rms_norm(x, weight, self.arch.rms_eps)

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I): SwiGLU or GeGLU
        if self.arch.mlp_act == "silu" and self.native:
            return ops.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.arch.mlp_act == "gelu_tanh":
            return F.gelu(gate, approximate="tanh") * up
        return F.silu(gate) * up

    def _qk_norm(self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor) -> torch.Tensor:
        """qkv (T, HD + 2 KD) -> the same with every q and k head RMS-normed over its D columns (v untouched)."""
        a = self.arch
        t, hd, kd = qkv.shape[0], a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        q = self._norm(qkv[:, :hd].reshape(t * a.num_heads, a.head_dim), q_norm)
        k = self._norm(qkv[:, hd : hd + kd].reshape(t * a.num_kv_heads, a.head_dim), k_norm)
        return torch.cat([q.view(t, hd), k.view(t, kd), qkv[:, hd + kd :]], dim=1)

    def _rotary(self, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor
                ) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
        """qkv (T, (H + 2 KVH) * D) -> q, k rotated by RoPE at `positions`, and v, as (T, heads, D) views."""
        a = self.arch
        sizes = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]

        def heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
            t = q.shape[0]
            return (q.view(t, a.num_heads, a.head_dim), k.view(t, a.num_kv_heads, a.head_dim),
                    v.view(t, a.num_kv_heads, a.head_dim))

        if self.native:  # in place on the fused rows, q and k heads in one call

            def rotate_native(qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
                ops.rope_(qkv, a.num_heads + a.num_kv_heads, a.head_dim, cos_table, sin_table, positions)
                return heads(*qkv.split(sizes, dim=-1))

            return rotate_native
        cos, sin = cos_table[positions], sin_table[positions]  # (T, D)

        def rotate_torch(qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
            q, k, v = heads(*qkv.split(sizes, dim=-1))
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

        return rotate_torch

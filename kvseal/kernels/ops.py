"""torch-facing wrappers of the native kernels: linear layers over GGUF blocks and paged decode attention.

A PackedWeight is a Linear weight (N, K) kept exactly as the GGUF file stores it: N rows of K / 32 blocks
(Q4_0, Q4_1 or Q8_0). Dequantized it equals, element for element, the float32 tensor the dense path uses;
the native path differs from the dense one only in summation order (a relative ~1e-6 in the logits).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvseal.kernels.build import load

# GGML type ids the kernels take, and their block sizes in bytes (32 weights per block).
Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
# At or above this many rows of x the weight is dequantized into a scratch tensor and multiplied by torch's
# GEMM (MKL/oneDNN), which wins once the product is compute-bound (prefill chunks).
DENSE_FROM_ROWS = 96


lib = load  # the library, built and loaded once per process (build.load is cached)


@dataclass(frozen=True)
class PackedWeight:
    qtype: int  # Q4_0 | Q4_1 | Q8_0
    n: int  # output features (rows)
    k: int  # input features, a multiple of 32
    data: torch.Tensor  # (n, k // 32 * BLOCK_BYTES[qtype]) uint8, contiguous, CPU

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"GGML type {self.qtype} has no native kernel (supported: Q4_0, Q4_1, Q8_0)")
        row = self.k // 32 * BLOCK_BYTES[self.qtype]
        if self.k % 32 or tuple(self.data.shape) != (self.n, row) or self.data.dtype != torch.uint8:
            raise ValueError(f"packed {TYPE_NAMES[self.qtype]} weight ({self.n}, {self.k}) needs uint8 data of "
                             f"shape ({self.n}, {row}), got {tuple(self.data.shape)} {self.data.dtype}")
        if not self.data.is_contiguous():
            raise ValueError("packed weight data must be contiguous")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:  # (n, k) float32
        out = torch.empty(self.n, self.k, dtype=torch.float32)
        _check(lib().kvs_dequant(self.qtype, self.data.data_ptr(), self.n, self.k, out.data_ptr()), "dequant")
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:  # (R,) int64 -> (R, k) float32: an embedding lookup
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], self.k, dtype=torch.float32)
        rc = lib().kvs_dequant_rows(self.qtype, self.data.data_ptr(), self.n, self.k, ids.data_ptr(),
                                    ids.shape[0], out.data_ptr())
        _check(rc, "dequant_rows")
        return out


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Fused projections (q|k|v, gate|up): rows are independent, so the blocks concatenate as bytes."""
    if len({(p.qtype, p.k) for p in parts}) != 1:
        raise ValueError("only weights of one type and input size can be fused")
    return PackedWeight(parts[0].qtype, sum(p.n for p in parts), parts[0].k, torch.cat([p.data for p in parts]))


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"native kernel {what} rejected its arguments (code {rc})")


def packed_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) float32 -> (M, N) = x @ W^T (+ bias)."""
    if x.shape[0] == 0:  # e.g. the lm_head of a prefill chunk that ends no prompt
        return torch.empty(0, w.n, dtype=torch.float32)
    if x.shape[0] >= DENSE_FROM_ROWS:
        return torch.nn.functional.linear(x, w.dequantize(), bias)
    x = x.contiguous()
    if x.dtype != torch.float32 or x.shape[-1] != w.k:
        raise ValueError(f"packed_linear takes float32 (M, {w.k}) inputs, got {x.dtype} {tuple(x.shape)}")
    y = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    _check(lib().kvs_gemm(w.qtype, w.data.data_ptr(), w.n, w.k, x.data_ptr(), x.shape[0], y.data_ptr()), "gemm")
    return y if bias is None else y + bias


def paged_decode_attention(
    q: torch.Tensor,  # (B, H, D) float32
    k_cache: torch.Tensor,  # (P, S, KVH, D) one layer's pool, contiguous
    v_cache: torch.Tensor,
    pages: torch.Tensor,  # (B, max_pages) int64 page tables
    kv_lens: torch.Tensor,  # (B,) int64
    scale: float,
) -> torch.Tensor:  # (B, H, D)
    b, h, d = q.shape
    p, s, kvh, _ = k_cache.shape
    q, pages, kv_lens = q.contiguous(), pages.contiguous(), kv_lens.contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_decode_attention needs a contiguous pool")
    out = torch.empty_like(q)
    rc = lib().kvs_paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), p, pages.data_ptr(),
                                pages.shape[1], kv_lens.data_ptr(), b, h, kvh, d, s, scale, out.data_ptr())
    _check(rc, "paged_decode")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, E) float32 -> weight * x / sqrt(mean(x^2) + eps)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _check(lib().kvs_rmsnorm(x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr()), "rmsnorm")
    return out


def rope_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
          positions: torch.Tensor) -> None:
    """In place on x (T, W) contiguous: rotate the first `heads` heads of head_dim columns of every row.
    cos/sin (max_pos, head_dim) tables, positions (T,) int64 (checked against the table's length)."""
    if not x.is_contiguous() or x.shape[1] < heads * head_dim:
        raise ValueError("rope_ needs a contiguous (T, >= heads * head_dim) tensor")
    rc = lib().kvs_rope(x.data_ptr(), x.shape[0], x.shape[1], heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                        positions.data_ptr(), cos.shape[0])
    _check(rc, "rope")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) contiguous -> silu(gate) * up, (T, I)."""
    t, i2 = gate_up.shape
    out = torch.empty(t, i2 // 2, dtype=torch.float32)
    _check(lib().kvs_silu_mul(gate_up.contiguous().data_ptr(), t, i2 // 2, out.data_ptr()), "silu_mul")
    return out


class LayerDesc(ctypes.Structure):
    """C's kvs_layer: one layer's weights for kvs_decode_forward (pointers into tensors the model keeps)."""

    _fields_ = [("t_qkv", ctypes.c_int32), ("t_o", ctypes.c_int32), ("t_gu", ctypes.c_int32),
                ("t_down", ctypes.c_int32), ("w_qkv", ctypes.c_void_p), ("w_o", ctypes.c_void_p),
                ("w_gu", ctypes.c_void_p), ("w_down", ctypes.c_void_p), ("b_qkv", ctypes.c_void_p),
                ("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p)]


def layer_table(layers: list[tuple[PackedWeight, PackedWeight, PackedWeight, PackedWeight, torch.Tensor | None,
                                   torch.Tensor, torch.Tensor]]) -> ctypes.Array[LayerDesc]:
    """(wqkv, wo, w_gate_up, w_down, bqkv, ln1, ln2) per layer -> the C array. The caller keeps the tensors."""
    table = (LayerDesc * len(layers))()
    for d, (qkv, o, gu, down, b, ln1, ln2) in zip(table, layers, strict=True):
        d.t_qkv, d.t_o, d.t_gu, d.t_down = qkv.qtype, o.qtype, gu.qtype, down.qtype
        d.w_qkv, d.w_o, d.w_gu, d.w_down = (w.data.data_ptr() for w in (qkv, o, gu, down))
        d.b_qkv = None if b is None else b.data_ptr()
        d.ln1, d.ln2 = ln1.data_ptr(), ln2.data_ptr()
    return table


def decode_forward(table: ctypes.Array[LayerDesc], dims: tuple[int, int, int, int, int, int], eps: float,
                   scale: float, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor,
                   kv_lens: torch.Tensor) -> None:
    """Run a decode-only step through every layer in C, in place on h (T, E).

    dims = (E, I, H, KVH, D, page_size); pools (L, P, S, KVH, D) contiguous float32; positions, slots (T,)
    int64; pages (T, max_pages), kv_lens (T,) int64. The C side checks every slot, page and length first."""
    e, i, hq, kvh, d, s = dims
    if not (h.is_contiguous() and k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("decode_forward needs contiguous h and pools")
    pages, kv_lens = pages.contiguous(), kv_lens.contiguous()
    rc = lib().kvs_decode_forward(table, len(table), e, i, hq, kvh, d, eps, scale, cos.data_ptr(), sin.data_ptr(),
                                  cos.shape[0], k_pool.data_ptr(), v_pool.data_ptr(), k_pool.shape[1], s,
                                  h.shape[0], h.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                                  pages.data_ptr(), pages.shape[1], kv_lens.data_ptr())
    _check(rc, "decode_forward")

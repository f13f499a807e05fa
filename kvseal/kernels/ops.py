"""torch-facing wrappers of the native kernels: linear layers over GGUF blocks and paged decode attention.

A PackedWeight is a Linear weight (N, K) kept exactly as the GGUF file stores it: N rows of K / 32 blocks
(Q4_0, Q4_1 or Q8_0). Dequantized it equals, element for element, the float32 tensor the dense path uses;
the native path differs from the dense one only in summation order (a relative ~1e-6 in the logits).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
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


@dataclass(frozen=True)
class QWeight:
    """A Linear weight (N, K) repacked by kvs_qpack for kvs_qlinear: tiles of 16 output columns (qgemm.c)."""

    qtype: int  # Q4_0 | Q4_1 | Q8_0, the block type it was packed from
    n: int
    k: int
    data: torch.Tensor  # uint8, kvs_qpacked_bytes(qtype, n, k) bytes

    @staticmethod
    def pack(w: PackedWeight) -> QWeight:
        size = lib().kvs_qpacked_bytes(w.qtype, w.n, w.k)
        if size < 0:
            raise ValueError(f"cannot repack a {TYPE_NAMES.get(w.qtype, w.qtype)} weight ({w.n}, {w.k})")
        out = torch.empty(size, dtype=torch.uint8)
        _check(lib().kvs_qpack(w.qtype, w.data.data_ptr(), w.n, w.k, out.data_ptr()), "qpack")
        return QWeight(w.qtype, w.n, w.k, out)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def set_threads(n: int) -> None:
    """The calling thread's kernel calls use n threads from now on."""
    lib().kvs_set_threads(n)


def match_torch_threads() -> None:
    """Give the calling thread's kernel calls torch's thread count (OpenMP's is per thread; an engine that steps
    on a thread of its own would otherwise use every core whatever --threads says)."""
    lib().kvs_set_threads(torch.get_num_threads())


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


Blocks = PackedWeight | QWeight


def layer_table(layers: Sequence[tuple[Blocks, Blocks, Blocks, Blocks, torch.Tensor | None, torch.Tensor, torch.Tensor]]
                ) -> ctypes.Array[LayerDesc]:
    """(wqkv, wo, w_gate_up, w_down, bqkv, ln1, ln2) per layer -> the C array (GGUF blocks for kvs_decode_forward,
    repacked blocks for kvs_forward_fast). The caller keeps the tensors."""
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


# -- the fast arithmetic: int8 activations x packed weights, paged attention over the "kt" page layout --------


def quantize_q8_0(w: torch.Tensor) -> PackedWeight:
    """A dense (N, K) weight as GGUF Q8_0 blocks (d = max|w| / 127 per 32 inputs, fp16; q = round(w / d)), for
    checkpoints that carry no blocks of their own (safetensors). K must be a multiple of 32."""
    n, k = w.shape
    if k % 32:
        raise ValueError(f"Q8_0 needs an input size that is a multiple of 32, got {k}")
    blocks = w.detach().to(torch.float32).reshape(n, k // 32, 32)
    d = (blocks.abs().amax(-1) / 127.0).to(torch.float16)  # (n, k/32), rounded as stored
    inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = torch.round(blocks * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    data = torch.cat([d.view(torch.uint8).reshape(n, k // 32, 2), q.view(torch.uint8)], dim=-1)
    return PackedWeight(Q8_0, n, k, data.reshape(n, -1).contiguous())


def qlinear(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) float32 -> (M, N): each row of x quantized to int8 per 32 inputs, integer dot products, float32
    scales. Row m of the result depends on row m of x only (batch invariance; qgemm.c)."""
    if x.shape[0] == 0:
        return torch.empty(0, w.n, dtype=torch.float32)
    x = x.contiguous()
    if x.dtype != torch.float32 or x.shape[-1] != w.k:
        raise ValueError(f"qlinear takes float32 (M, {w.k}) inputs, got {x.dtype} {tuple(x.shape)}")
    y = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    _check(lib().kvs_qlinear(w.qtype, w.data.data_ptr(), w.n, w.k, x.data_ptr(), x.shape[0], y.data_ptr()), "qlinear")
    return y if bias is None else y + bias


QISA_NAMES = {3: "avx512-vnni", 2: "avx-vnni", 1: "avx2"}


def qisa() -> str:
    """The instruction set kvs_qlinear dispatches to on this CPU (every one gives the same bits). KVSEAL_QISA
    (1, 2 or 3: a lower path on a CPU that has a higher one) naming a set this CPU lacks is a RuntimeError: the
    kernels never run it (no SIGILL), and nothing runs on another set than the one asked for without saying so."""
    refused = lib().kvs_qisa_refused()
    if refused:
        have = ", ".join(QISA_NAMES[i] for i in qisa_available())
        asked = f"{QISA_NAMES[refused]}, which this CPU lacks" if refused in QISA_NAMES else "no instruction set"
        raise RuntimeError(f"KVSEAL_QISA={os.environ.get('KVSEAL_QISA', '')!r} asks for {asked} (it has: {have}). "
                           f"Fix: unset KVSEAL_QISA, or set it to one of " +
                           ", ".join(f"{i} ({QISA_NAMES[i]})" for i in qisa_available()))
    return QISA_NAMES[lib().kvs_qisa()]


def qisa_available() -> list[int]:
    """The integer instruction sets this CPU has (1 avx2, 2 avx-vnni, 3 avx512-vnni), each checked on its own."""
    have = lib().kvs_qisa_have()
    return [i for i in QISA_NAMES if (have >> i) & 1][::-1]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v (T, KVH, D) float32 into slots (T,) int64 of one layer's pools: keys (P, KVH, D, S), values
    (P, S, KVH, D), float32 or bfloat16. Every slot is checked against the pool first."""
    p, kvh, d, s = k_pool.shape
    if v_pool.shape != (p, s, kvh, d) or not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError(f"write_kv needs contiguous kt pools, got {tuple(k_pool.shape)} / {tuple(v_pool.shape)}")
    k, v, slots = k.contiguous(), v.contiguous(), slots.contiguous()
    bf16 = int(k_pool.dtype == torch.bfloat16)
    rc = lib().kvs_write_kv(k.data_ptr(), v.data_ptr(), k.shape[0], kvh, d, k_pool.data_ptr(), v_pool.data_ptr(),
                            bf16, p, s, slots.data_ptr())
    _check(rc, "write_kv")


def paged_attention_kt(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, spans: torch.Tensor,
                       tables: torch.Tensor, scale: float) -> torch.Tensor:
    """q (T, H, D) float32; one layer's pools, keys (P, KVH, D, S), values (P, S, KVH, D); spans (n, 5) int64 rows
    (first row, rows, first position, offset into tables, pages); tables: the spans' page tables, concatenated.
    -> (T, H, D). Each row's result is independent of chunking and batch (attention.c)."""
    t, h, d = q.shape
    p, kvh, _, s = k_pool.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    bf16 = int(k_pool.dtype == torch.bfloat16)
    rc = lib().kvs_paged_attention(q.data_ptr(), t, h, kvh, d, k_pool.data_ptr(), v_pool.data_ptr(), bf16, p, s,
                                   spans.data_ptr(), spans.shape[0], tables.data_ptr(), tables.shape[0], scale,
                                   out.data_ptr())
    _check(rc, "paged_attention")
    return out


def forward_fast(table: ctypes.Array[LayerDesc], dims: tuple[int, int, int, int, int], eps: float, scale: float,
                 cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, h: torch.Tensor,
                 positions: torch.Tensor, slots: torch.Tensor, spans: torch.Tensor, tables: torch.Tensor) -> None:
    """Every layer of a fast-arithmetic step in one C call, in place on h (T, E) (forward.c).

    dims = (E, I, H, KVH, D); pools: keys (L, P, KVH, D, S), values (L, P, S, KVH, D), float32 or bfloat16; positions,
    slots (T,) int64; spans (n, 5), tables as for paged_attention_kt. The C side checks every span, page, slot and
    position first and writes nothing when one is wrong."""
    e, i, hq, kvh, d = dims
    if not (h.is_contiguous() and k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("forward_fast needs contiguous h and pools")
    _, p, _, _, s = k_pool.shape
    bf16 = int(k_pool.dtype == torch.bfloat16)
    rc = lib().kvs_forward_fast(table, len(table), e, i, hq, kvh, d, eps, scale, cos.data_ptr(), sin.data_ptr(),
                                cos.shape[0], k_pool.data_ptr(), v_pool.data_ptr(), bf16, p, s, h.shape[0],
                                h.data_ptr(), positions.data_ptr(), slots.data_ptr(), spans.data_ptr(),
                                spans.shape[0], tables.data_ptr(), tables.shape[0])
    _check(rc, "forward_fast")

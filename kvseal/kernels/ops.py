"""torch-facing wrappers of the native kernels: linear layers over GGUF blocks and paged decode attention.

The weights they read (PackedWeight, FusedRows, QWeight, the GGUF block types) are in kernels/weights.py. The
native path differs from the dense one only in summation order (a relative ~1e-6 in the logits).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import torch

from kvseal.kernels.weights import DENSE_FROM_ROWS, MAX_SEGMENTS, FusedRows, PackedWeight, QWeight, _check, lib


class MatDesc(ctypes.Structure):
    """C's kvs_mat (kvs.h): a matrix as row segments, each of one type."""

    _fields_ = [("nseg", ctypes.c_int32), ("type", ctypes.c_int32 * MAX_SEGMENTS),
                ("rows", ctypes.c_int64 * MAX_SEGMENTS), ("data", ctypes.c_void_p * MAX_SEGMENTS)]


Blocks = PackedWeight | FusedRows | QWeight


def mat_desc(w: Blocks) -> MatDesc:
    if isinstance(w, QWeight):
        segs = list(zip(w.qtypes, w.rows, (d.data_ptr() for d in w.datas), strict=True))
    else:
        parts = w.parts if isinstance(w, FusedRows) else (w,)
        segs = [(p.qtype, p.n, p.data.data_ptr()) for p in parts]
    d = MatDesc()
    d.nseg = len(segs)
    for i, (t, n, ptr) in enumerate(segs):
        d.type[i], d.rows[i], d.data[i] = t, n, ptr
    return d


def set_threads(n: int) -> None:
    """The calling thread's kernel calls use n threads from now on."""
    lib().kvs_set_threads(n)


def one_thread_here() -> int:
    """torch's and the kernels' work runs on one thread from now on, so the calling thread never starts an OpenMP
    team; returns the count torch had, for the engine loop's thread to take (EngineLoop's `threads`). For a thread
    that loads an engine and hands it to a loop thread (`kvseal serve --unified`): once a process holds more OpenMP
    threads than CPUs, libgomp waits at each barrier for about 100 spins and then sleeps, and a second team beside
    the loop's made one stream's decode 1.4x slower (docs/benchmarks.md, issue 32)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's count and its BLAS's, which are process-wide; the loop thread sets them back
    set_threads(1)
    return n


def match_torch_threads() -> None:
    """Give the calling thread's kernel calls torch's thread count (OpenMP's is per thread; an engine that steps
    on a thread of its own would otherwise use every core whatever --threads says)."""
    lib().kvs_set_threads(torch.get_num_threads())


def packed_linear(x: torch.Tensor, w: PackedWeight | FusedRows, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) float32 -> (M, N) = x @ W^T (+ bias)."""
    if x.shape[0] == 0:  # e.g. the lm_head of a prefill chunk that ends no prompt
        return torch.empty(0, w.n, dtype=torch.float32)
    if x.shape[0] >= DENSE_FROM_ROWS:
        return torch.nn.functional.linear(x, w.dequantize(), bias)
    x = x.contiguous()
    if x.dtype != torch.float32 or x.shape[-1] != w.k:
        raise ValueError(f"packed_linear takes float32 (M, {w.k}) inputs, got {x.dtype} {tuple(x.shape)}")
    y = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    m = mat_desc(w)
    _check(lib().kvs_gemm_mat(ctypes.byref(m), w.k, x.data_ptr(), x.shape[0], y.data_ptr()), "gemm")
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
    """C's kvs_layer (kvs.h): one layer's weights (pointers into tensors the model keeps)."""

    _fields_ = [("qkv", MatDesc), ("o", MatDesc), ("gu", MatDesc), ("down", MatDesc), ("b_qkv", ctypes.c_void_p),
                ("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p)]


def layer_table(layers: Sequence[tuple[Blocks, Blocks, Blocks, Blocks, torch.Tensor | None, torch.Tensor, torch.Tensor]]
                ) -> ctypes.Array[LayerDesc]:
    """(wqkv, wo, w_gate_up, w_down, bqkv, ln1, ln2) per layer -> the C array (GGUF blocks for kvs_decode_forward,
    QWeights for kvs_forward_fast). The caller keeps the tensors."""
    table = (LayerDesc * len(layers))()
    for d, (qkv, o, gu, down, b, ln1, ln2) in zip(table, layers, strict=True):
        d.qkv, d.o, d.gu, d.down = (mat_desc(w) for w in (qkv, o, gu, down))
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


def qlinear(x: torch.Tensor, w: QWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) float32 -> (M, N): each row of x quantized to int8 per 32 inputs, integer dot products, float32
    scales (float segments: float32 FMA). Row m of the result depends on row m of x only (batch invariance;
    qgemm.c)."""
    if x.shape[0] == 0:
        return torch.empty(0, w.n, dtype=torch.float32)
    x = x.contiguous()
    if x.dtype != torch.float32 or x.shape[-1] != w.k:
        raise ValueError(f"qlinear takes float32 (M, {w.k}) inputs, got {x.dtype} {tuple(x.shape)}")
    y = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    scratch = torch.empty(int(lib().kvs_qscratch_bytes(x.shape[0], w.k)), dtype=torch.uint8)
    m = mat_desc(w)
    rc = lib().kvs_qlinear_mat(ctypes.byref(m), w.k, x.data_ptr(), x.shape[0], y.data_ptr(), scratch.data_ptr())
    _check(rc, "qlinear")
    return y if bias is None else y + bias


QISA_NAMES = {4: "amx-int8", 3: "avx512-vnni", 2: "avx-vnni", 1: "avx2"}


def qisa() -> str:
    """The instruction set kvs_qlinear dispatches to on this CPU (every one gives the same bits; amx-int8 runs
    AMX tiles from 16 rows of x and AVX-512-VNNI below). KVSEAL_QISA (1, 2, 3 or 4: a lower path on a CPU that
    has a higher one) naming a set this CPU lacks is a RuntimeError: the
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
    """The integer instruction sets this CPU has (1 avx2, 2 avx-vnni, 3 avx512-vnni, 4 amx-int8: AMX tiles the OS
    grants this process), each checked on its own."""
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

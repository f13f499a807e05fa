"""The weights the native kernels read: GGUF block types, and a Linear weight kept as the file stores it.

A PackedWeight is a Linear weight (N, K) kept exactly as the GGUF file stores it: N rows of blocks of any type in
BLOCK_BYTES (Q4_0, Q4_1, Q5_0, Q8_0 per 32 weights; Q4_K, Q5_K, Q6_K per 256; F32, F16, BF16 as they are).
Dequantized it equals, bit for bit, the float32 tensor gguf-py (and transformers) make of it; the native path
differs from the dense one only in summation order (a relative ~1e-6 in the logits). FusedRows puts several
(q|k|v, gate|up) side by side without copying them, whatever their types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvseal.kernels.build import load

# GGML type ids the kernels take: (weights, bytes) per block as stored
F32, F16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 8, 12, 13, 14, 30
BLOCKS = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q8_0: (32, 34),
          Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
FLOAT_TYPES = (F32, F16, BF16)
# the quantized block types: what a loader keeps as PackedWeights of the file's bytes (float tensors may be handed
# over as PackedWeights too, of their raw bytes, or as dense tensors: PackedWeight.of_dense)
BLOCK_BYTES = {t: b for t, (_, b) in BLOCKS.items() if t not in FLOAT_TYPES}
TYPE_NAMES = {F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q8_0: "Q8_0",
              Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
# At or above this many rows of x the weight is dequantized into a scratch tensor and multiplied by torch's
# GEMM (MKL/oneDNN), which wins once the product is compute-bound (prefill chunks).
DENSE_FROM_ROWS = 96


lib = load  # the library, built and loaded once per process (build.load is cached)


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one stored row of k weights. ValueError naming the type, k and the fix when no kernel takes it:
    every type needs k a multiple of 32, the K-quants (whose super-blocks hold 256) a multiple of 256."""
    if qtype not in BLOCKS:
        names = ", ".join(TYPE_NAMES[t] for t in BLOCKS)
        raise ValueError(f"GGML type {qtype} has no native kernel (supported: {names}); re-quantize the model to "
                         "one of these")
    elems, size = BLOCKS[qtype]
    step = max(32, elems)
    if k <= 0 or k % step:
        raise ValueError(f"a {TYPE_NAMES[qtype]} weight needs an input size that is a multiple of {step}, got {k}; "
                         "re-quantize this tensor to a type with "
                         f"{'32-weight blocks (Q8_0, Q5_0)' if step > 32 else 'that size'}")
    return k // elems * size


@dataclass(frozen=True)
class PackedWeight:
    qtype: int  # a key of BLOCKS
    n: int  # output features (rows)
    k: int  # input features: a multiple of 32 (256 for the K-quants)
    data: torch.Tensor  # (n, row_bytes(qtype, k)) uint8, contiguous, CPU

    def __post_init__(self) -> None:
        row = row_bytes(self.qtype, self.k)
        if tuple(self.data.shape) != (self.n, row) or self.data.dtype != torch.uint8:
            raise ValueError(f"packed {TYPE_NAMES[self.qtype]} weight ({self.n}, {self.k}) needs uint8 data of "
                             f"shape ({self.n}, {row}), got {tuple(self.data.shape)} {self.data.dtype}")
        if not self.data.is_contiguous():
            raise ValueError("packed weight data must be contiguous")

    @staticmethod
    def of_dense(w: torch.Tensor) -> PackedWeight:
        """A float32, float16 or bfloat16 (N, K) tensor as an F32/F16/BF16 weight, sharing its memory."""
        qtype = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}.get(w.dtype)
        if qtype is None or w.dim() != 2:
            raise ValueError(f"of_dense takes a 2-D float32/float16/bfloat16 tensor, got {w.dtype} {tuple(w.shape)}")
        w = w.contiguous()
        return PackedWeight(qtype, w.shape[0], w.shape[1], w.view(torch.uint8).view(w.shape[0], -1))

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


MAX_SEGMENTS = 4  # kvs.h KVS_MAXSEG


@dataclass(frozen=True)
class FusedRows:
    """Several weights of one input size as one (sum n, k) matrix (q|k|v, gate|up), each part kept where it is
    and in its own type: the kernels write each part's outputs into its own columns of one result."""

    parts: tuple[PackedWeight, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.parts) <= MAX_SEGMENTS or len({p.k for p in self.parts}) != 1:
            raise ValueError(f"FusedRows takes 1 to {MAX_SEGMENTS} weights of one input size, got "
                             f"{[(p.n, p.k) for p in self.parts]}")

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k

    def dequantize(self) -> torch.Tensor:  # (n, k) float32
        return torch.cat([p.dequantize() for p in self.parts])


def fuse_rows(parts: Sequence[PackedWeight]) -> PackedWeight | FusedRows:
    return parts[0] if len(parts) == 1 else FusedRows(tuple(parts))


@dataclass(frozen=True)
class QWeight:
    """A Linear weight (N, K) for the fast arithmetic: up to MAX_SEGMENTS row segments (q|k|v), each repacked by
    kvs_qpack from its own block type into tiles of 16 output columns (qpack.c), or a float weight as stored."""

    qtypes: tuple[int, ...]
    rows: tuple[int, ...]
    k: int
    datas: tuple[torch.Tensor, ...]  # uint8, kvs_qpacked_bytes(qtype, rows, k) bytes each

    @staticmethod
    def packed_bytes(w: PackedWeight) -> int:
        return int(lib().kvs_qpacked_bytes(w.qtype, w.n, w.k))

    @staticmethod
    def pack_into(w: PackedWeight, out: torch.Tensor) -> None:
        """Repack w into out (QWeight.packed_bytes(w) uint8, contiguous: e.g. a slice of a cache file)."""
        if out.dtype != torch.uint8 or out.numel() != QWeight.packed_bytes(w) or not out.is_contiguous():
            raise ValueError(f"pack_into needs {QWeight.packed_bytes(w)} contiguous uint8 bytes")
        rc = lib().kvs_qpack(w.qtype, w.data.data_ptr(), w.n, w.k, out.data_ptr())
        _check(rc, f"qpack ({TYPE_NAMES.get(w.qtype, w.qtype)} ({w.n}, {w.k}))")

    @staticmethod
    def pack(*parts: PackedWeight) -> QWeight:
        """The parts (one input size) as one matrix; float parts are used as stored (no copy)."""
        if not 1 <= len(parts) <= MAX_SEGMENTS or len({p.k for p in parts}) != 1:
            raise ValueError(f"QWeight.pack takes 1 to {MAX_SEGMENTS} weights of one input size")
        datas = []
        for w in parts:
            if w.qtype in FLOAT_TYPES:
                datas.append(w.data.view(-1))
                continue
            size = QWeight.packed_bytes(w)
            if size < 0:
                raise ValueError(f"cannot repack a {TYPE_NAMES.get(w.qtype, w.qtype)} weight ({w.n}, {w.k})")
            out = torch.empty(size, dtype=torch.uint8)
            QWeight.pack_into(w, out)
            datas.append(out)
        return QWeight(tuple(p.qtype for p in parts), tuple(p.n for p in parts), parts[0].k, tuple(datas))

    @property
    def n(self) -> int:
        return sum(self.rows)

    @property
    def nbytes(self) -> int:
        return sum(d.numel() for d in self.datas)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"native kernel {what} rejected its arguments (code {rc})")

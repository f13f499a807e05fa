"""A quantized weight as the file stores it (GGML blocks, a read-only view of the mapped file), and the only ways
kvseal turns it into floats: a few rows at a time, into a buffer the caller owns (an embedding lookup, or the
reference path's reused scratch). No float32 copy of a whole quantized matrix is ever kept.

Dequantization runs in kvseal's native kernels for the block types they take (kvs_dequant / kvs_dequant_rows,
equal to gguf-py's to the last rounding of an fma), else in gguf-py's reference code (every GGML type, slower).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import gguf
import numpy as np
import torch


@cache
def native_dequant_types() -> frozenset[int]:
    """GGML types the native kernels dequantize on this machine (empty when they cannot load)."""
    from kvseal.kernels.build import cpu_supports

    if not cpu_supports().ok:
        return frozenset()
    try:
        from kvseal.kernels import weights

        weights.lib()
    except (RuntimeError, OSError):
        return frozenset()
    return frozenset(weights.BLOCKS)


def row_bytes(qtype: int, k: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    if k % block:
        raise ValueError(f"{gguf.GGMLQuantizationType(qtype).name} rows of {k} elements are not whole blocks of "
                         f"{block}")
    return k // block * size


@dataclass(frozen=True)
class QuantTensor:
    """A weight of `n` rows of `k` elements stored in GGML blocks of type `qtype`.

    data: (n, row_bytes) uint8 in the file's row order, usually a read-only view of the mapped GGUF file.
    row_order: (n,) int64 or None. Row r of the weight (Hugging Face order) is stored at data row row_order[r];
      llama.cpp's converter permuted the q/k rows of llama models, and this undoes it without a copy.
    offset: where data starts in the file (-1 when not from a file), so a one-time pass can release its pages.
    """

    qtype: int
    n: int
    k: int
    data: torch.Tensor
    row_order: torch.Tensor | None = None
    offset: int = -1

    def __post_init__(self) -> None:
        rb = row_bytes(self.qtype, self.k)
        if tuple(self.data.shape) != (self.n, rb) or self.data.dtype != torch.uint8:
            raise ValueError(f"{self.type_name} weight ({self.n}, {self.k}) needs uint8 data of shape ({self.n}, "
                             f"{rb}), got {tuple(self.data.shape)} {self.data.dtype}")
        if self.row_order is not None and tuple(self.row_order.shape) != (self.n,):
            raise ValueError(f"row_order of a {self.n}-row weight has shape {tuple(self.row_order.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def type_name(self) -> str:
        return gguf.GGMLQuantizationType(self.qtype).name

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def file_rows(self, rows: torch.Tensor | slice) -> torch.Tensor | slice:
        """Where the weight's rows `rows` are stored."""
        if self.row_order is None:
            return rows
        return self.row_order[rows]

    def rows_into(self, rows: torch.Tensor | slice, out: torch.Tensor, native: bool = True) -> None:
        """out (R, k) float32 contiguous <- the weight's rows `rows` (an int64 index tensor or a slice).
        native=False: gguf-py's reference dequantization even where the kernels could do it."""
        where = self.file_rows(rows)
        if native and self.qtype in native_dequant_types():
            from kvseal.kernels import ops

            if isinstance(where, slice):  # kvs_dequant_rows: one thread, no OpenMP region per call
                where = torch.arange(*where.indices(self.n))
            ids = where.to(torch.int64).contiguous()
            rc = ops.lib().kvs_dequant_rows(self.qtype, self.data.data_ptr(), self.n, self.k, ids.data_ptr(),
                                            ids.shape[0], out.data_ptr())
            if rc != 0:
                raise RuntimeError(f"native dequantization of a {self.type_name} weight failed (code {rc})")
            return
        blocks = np.ascontiguousarray(self.data[where].numpy())
        deq = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(self.qtype))
        out.copy_(torch.from_numpy(np.asarray(deq, dtype=np.float32).reshape(out.shape)))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(R,) int64 -> (R, k) float32: an embedding lookup."""
        out = torch.empty(ids.shape[0], self.k, dtype=torch.float32)
        self.rows_into(ids.to(torch.int64), out)
        return out

    def dequantize(self, native: bool = True) -> torch.Tensor:
        """(n, k) float32: a whole float copy, for comparisons in tests and benchmarks. No model path calls it
        (tests/unit/test_loaders.py checks); the model dequantizes a chunk at a time into its scratch."""
        out = torch.empty(self.n, self.k, dtype=torch.float32)
        self.rows_into(slice(None), out, native)
        return out

    def blocks_in_order(self) -> torch.Tensor:
        """(n, row_bytes) uint8 in the weight's row order: the view itself, or a copy of the permuted rows."""
        return self.data if self.row_order is None else self.data[self.row_order]

"""The matrices a model multiplies by, in the form its arithmetic takes, made from a Checkpoint without ever
holding a float32 copy of a quantized weight.

  torch (the reference path)  a quantized weight is a `Dequantized`: each call dequantizes it, a chunk of rows at a
                              time, into one reused scratch buffer and multiplies with torch (F.linear).
  exact (native kernels)      GGUF blocks as stored, views of the mapped file; q|k|v and gate|up side by side
                              whatever their types (ops.FusedRows, no copy). Only llama q/k rows, which llama.cpp
                              permuted, are put back in order once, into the weights cache (model/weight_cache.py).
                              A block type the kernels do not take is dequantized per call, as on the reference path.
  fast                        every matrix repacked by QWeight.pack (each part from its own type; float parts as they
                              are), written once into the weights cache and mapped.
A checkpoint without a content key (a Hugging Face folder, an in-memory test model) keeps what it derives in
memory. Norms and biases are float32 copies (they are not quantized weights).
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvseal.kernels.ops import packed_linear, qlinear
from kvseal.kernels.weights import BLOCKS, FusedRows, PackedWeight, QWeight, fuse_rows
from kvseal.model.checkpoint import Checkpoint
from kvseal.model.quant import QuantTensor

SCRATCH_BYTES = 64 << 20  # the reference path's dequantization buffer: matrices above it go in row chunks

log = logging.getLogger("kvseal.model")


class Scratch:
    """One float32 buffer, grown on demand up to SCRATCH_BYTES and reused by every Dequantized of a model."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.float32)

    def take(self, numel: int) -> torch.Tensor:
        if self._buf.numel() < numel:
            self._buf = torch.empty(numel, dtype=torch.float32)
        return self._buf[:numel]


@dataclass(frozen=True)
class Dequantized:
    """Rows of quantized (QuantTensor) or float parts, multiplied as floats dequantized call by call."""

    parts: tuple[QuantTensor | torch.Tensor, ...]
    k: int
    dtype: torch.dtype
    device: torch.device
    scratch: Scratch = field(repr=False, compare=False)

    @property
    def n(self) -> int:
        return sum(p.shape[0] if isinstance(p, torch.Tensor) else p.n for p in self.parts)

    def _fill(self, r0: int, r1: int, out: torch.Tensor) -> None:
        """out (r1 - r0, k) <- rows r0:r1 of the stacked parts."""
        base = 0
        for p in self.parts:
            rows = p.shape[0] if isinstance(p, torch.Tensor) else p.n
            a, b = max(r0, base), min(r1, base + rows)
            if a < b:
                dst = out[a - r0 : b - r0]
                if isinstance(p, torch.Tensor):
                    dst.copy_(p[a - base : b - base])
                else:
                    p.rows_into(slice(a - base, b - base), dst)
            base += rows

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n, k = self.n, self.k
        step = max(1, SCRATCH_BYTES // 4 // k)
        out = None if n <= step else torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            w = self.scratch.take((r1 - r0) * k).view(r1 - r0, k)
            self._fill(r0, r1, w)
            w = w.to(device=self.device, dtype=self.dtype)
            if out is None:  # the whole matrix at once: the same F.linear as on a dense weight
                return F.linear(x, w, bias)
            out[:, r0:r1] = F.linear(x, w, None if bias is None else bias[r0:r1])
        assert out is not None
        return out


# a dense (N, K) tensor, GGUF blocks for the exact kernels (FusedRows: several side by side, each in its own type),
# blocks repacked for the fast arithmetic, or quantized rows dequantized call by call
Weight = torch.Tensor | PackedWeight | FusedRows | QWeight | Dequantized
# what an embedding lookup reads: dense rows, GGUF blocks the kernels dequantize, or blocks gguf-py dequantizes
Embedding = torch.Tensor | PackedWeight | QuantTensor


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, QWeight):
        return qlinear(x, w, bias)
    if isinstance(w, PackedWeight | FusedRows):
        return packed_linear(x, w, bias)
    if isinstance(w, Dequantized):
        return w.linear(x, bias)
    return F.linear(x, w, bias)


def cache_key(ckpt: Checkpoint, form: str) -> tuple[str, str]:
    """(file stem, full key) of a checkpoint's weights cache for `form`: its content, the cache format and the
    kernels' version (the hash of their source: a kernels change may change how blocks are packed)."""
    from kvseal.kernels.build import library_path
    from kvseal.model.weight_cache import FORMAT_VERSION

    key = f"{ckpt.content_key}|{form}|format{FORMAT_VERSION}|{library_path().stem}"
    return f"{ckpt.content_key[:24]}-{form}-{hashlib.sha256(key.encode()).hexdigest()[:12]}", key


class ModelWeights:
    """Hands a model its weights (see the module docstring). Use as a context manager around the model's
    construction: leaving it publishes a weights cache that was built, or discards it on an error."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, native: bool, fast: bool = False,
                 progress: bool = True) -> None:
        self.ckpt, self.dtype, self.device, self.native, self.fast = ckpt, dtype, device, native, fast
        self.scratch = Scratch()
        self.cache = None
        self.form = "fast" if fast else "exact"
        self._t0 = time.perf_counter()
        self._bar: tqdm | None = None
        self._per_call: set[str] = set()  # block types dequantized per call although the kernels run
        if native and ckpt.content_key:
            from kvseal.model.file_index import weights_cache_dir
            from kvseal.model.weight_cache import WeightCache

            stem, key = cache_key(ckpt, self.form)
            total = sum(q.nbytes for q in ckpt.packed.values()) + sum(
                t.numel() * 4 for n, t in ckpt.weights.items() if t.dim() == 2)
            try:
                self.cache = WeightCache(weights_cache_dir(), stem, key, reserve=4 * total + (64 << 20))
            except OSError as e:
                log.warning("no weights cache (%s); derived weights stay in memory", e)
            if not fast:  # exact derives only the llama q/k whose rows it puts back in order
                total = sum(q.nbytes for q in ckpt.packed.values() if q.row_order is not None)
            if self.cache is not None and self.cache.building:
                self._bar = tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr, delay=2.0,
                                 desc=f"packing {self.form} weights", disable=not progress)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._per_call:
            log.warning("the native kernels take no %s blocks: those weights are dequantized at every step (slow)",
                        ", ".join(sorted(self._per_call)))
        if self.cache is None:
            return
        if exc_type is not None:
            self.cache.discard()
            return
        self.cache.finish()
        if self.cache.in_use:
            what = "built" if self.cache.built else "mapped"
            log.info("weights cache %s: %s in %.2f s", what, self.cache.path, time.perf_counter() - self._t0)

    # -- what a model asks for --------------------------------------------------------------------------------
    def dense(self, name: str) -> torch.Tensor:
        """A float tensor (norm, bias, or a weight stored as floats)."""
        return self.ckpt.weights[name].to(device=self.device, dtype=self.dtype)

    def embedding(self, name: str) -> Embedding:
        """Rows are only looked up: never derived, always read where they lie."""
        q = self.ckpt.packed.get(name)
        if q is None:
            return self.dense(name)
        if self.native and q.qtype in BLOCKS and q.row_order is None:
            return PackedWeight(q.qtype, q.n, q.k, q.data)
        return q

    def get(self, *names: str) -> Weight:
        """One matrix, or several stacked along their rows (output features), in this arithmetic's form."""
        parts = [self.ckpt.packed.get(n, None) for n in names]
        if not self.native:
            if all(p is None for p in parts):
                return self._dense_cat(names)
            return Dequantized(tuple(p if p is not None else self.ckpt.weights[n] for p, n in zip(parts, names)),
                               self._k(names[0]), self.dtype, self.device, self.scratch)
        missing = sorted({p.type_name for p in parts if p is not None and p.qtype not in BLOCKS})
        if missing:
            if self.fast:  # the engine resolves to exact when the kernels lack a block type (Checkpoint.block_types)
                raise ValueError(f"the fast arithmetic cannot take {', '.join(names)} ({', '.join(missing)} blocks)")
            self._per_call.update(missing)
            return Dequantized(tuple(p if p is not None else self.ckpt.weights[n] for p, n in zip(parts, names)),
                               self._k(names[0]), self.dtype, self.device, self.scratch)
        if self.fast:  # every part repacked from its own type (floats as they are), once, into the cache
            return self._derived(names, lambda: QWeight.pack(*(self._block(n) for n in names)))
        if all(p is not None for p in parts):  # fused side by side, no copy
            return fuse_rows([self._block(n) for n in names])
        return self._dense_cat(names)

    # -- helpers ----------------------------------------------------------------------------------------------
    def _k(self, name: str) -> int:
        q = self.ckpt.packed.get(name)
        return q.k if q is not None else int(self.ckpt.weights[name].shape[1])

    def _dense_cat(self, names: tuple[str, ...]) -> torch.Tensor:
        return self.dense(names[0]) if len(names) == 1 else torch.cat([self.dense(n) for n in names])

    def _block(self, name: str) -> PackedWeight:
        """One weight as the kernels take it: the file's blocks where they lie; llama q/k rows put back in order
        (a copy: transient when fast, which repacks it; cached when exact); a float weight as it is."""
        q = self.ckpt.packed.get(name)
        if q is None:
            return PackedWeight.of_dense(self.dense(name))
        if q.row_order is None:
            return PackedWeight(q.qtype, q.n, q.k, q.data)

        def reordered() -> PackedWeight:
            return PackedWeight(q.qtype, q.n, q.k, q.blocks_in_order())

        return reordered() if self.fast else self._derived((name,), reordered)  # type: ignore[return-value]

    def _derived(self, names: tuple[str, ...], make: Callable[[], Weight]) -> Weight:
        """A weight made once: from the cache file, or made now (and stored there when building)."""
        key = "+".join(names)
        if self.cache is not None:
            found = self.cache.lookup(key)
            if found is not None:
                return found  # type: ignore[no-any-return]
        value = make()
        if self.cache is not None:
            value = self.cache.store(key, value)
        self._done(names)
        return value

    def _done(self, names: tuple[str, ...]) -> None:
        """The sources of a derived weight were read once: drop their pages from this process."""
        for n in names:
            q = self.ckpt.packed.get(n)
            if q is not None:
                self.ckpt.release(q)
            if self._bar is not None:
                self._bar.update(q.nbytes if q is not None else self.ckpt.weights[n].numel() * 4)

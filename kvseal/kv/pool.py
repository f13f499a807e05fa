"""The KV pool: the tensors, nothing else. Ownership lives in the allocator.

Layouts (a page is one contiguous block of each tensor per layer, whatever the layout):
  "std": k, v (num_layers, num_pages, page_size, kv_heads, head_dim)
  "kt":  k (num_layers, num_pages, kv_heads, head_dim, page_size): keys transposed inside each page, so the fast
         attention kernel reads 16 keys at one input as 16 contiguous values; v as in "std".
Capacity in tokens = num_pages * page_size.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

from kvseal.config import CacheConfig
from kvseal.model.arch import ModelArch


def kv_bytes_per_token(arch: ModelArch, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * elem


def pool_num_pages(arch: ModelArch, cache: CacheConfig, dtype: torch.dtype, default_tokens: int) -> int:
    """Pages in the pool: from --kv-pool-tokens, --kv-pool-bytes, or `default_tokens` when neither is set."""
    if cache.pool_tokens is not None:
        tokens = cache.pool_tokens
    elif cache.pool_bytes is not None:
        tokens = cache.pool_bytes // kv_bytes_per_token(arch, dtype)
    else:
        tokens = default_tokens
    pages = tokens // cache.page_size
    if pages < 1:
        raise ValueError(
            f"a KV pool of {tokens} tokens holds no whole page of {cache.page_size} tokens: raise the pool size"
        )
    return pages


def zeroed_cpu(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in an anonymous private map: the kernel zeroes each page when it is first touched, so a
    pool of gigabytes costs nothing at start (torch.zeros wrote every page: 1.1 to 1.8 s for the 1.5B's
    65,536-token pool on 2 cores) and holds memory only for the pages used. The tensor keeps the map alive
    (torch.frombuffer holds a reference to it; every view does through the storage)."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    m = mmap.mmap(-1, numel * torch.empty((), dtype=dtype).element_size(), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(m, dtype=dtype, count=numel).view(shape)


LAYOUTS = ("std", "kt")


def layout_name(arch: ModelArch, layout: str) -> str:
    """The layout string workers compare (fleet check, manifest): e.g. "L30xPxSx3x64" or "kt:L30xPx3x64xS"."""
    if layout == "kt":
        return f"kt:L{arch.num_layers}xPx{arch.num_kv_heads}x{arch.head_dim}xS"
    return f"L{arch.num_layers}xPxSx{arch.num_kv_heads}x{arch.head_dim}"


class KVPool:
    def __init__(self, arch: ModelArch, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, layout: str = "std", num_layers: int | None = None) -> None:
        """num_layers: the layers this pool holds (None: all of arch's; kv/window.py splits them in two)."""
        if layout not in LAYOUTS:
            raise ValueError(f"unknown KV layout {layout!r}: use one of {', '.join(LAYOUTS)}")
        nl = arch.num_layers if num_layers is None else num_layers
        shape = (nl, num_pages, page_size, arch.num_kv_heads, arch.head_dim)
        kshape = (nl, num_pages, arch.num_kv_heads, arch.head_dim, page_size) if layout == "kt" else shape
        # zeros: on the CPU in memory the kernel zeroes on first touch (zeroed_cpu)
        self.k, self.v = (zeroed_cpu(s, dtype) if device.type == "cpu" else torch.zeros(s, dtype=dtype, device=device)
                          for s in (kshape, shape))
        self.num_pages, self.page_size, self.dtype, self.layout = num_pages, page_size, dtype, layout
        self.layout_name = layout_name(arch, layout)
        self.bytes_per_token = kv_bytes_per_token(arch, dtype)  # every layer's: a handoff's unit
        self.page_bytes = 2 * nl * page_size * arch.num_kv_heads * arch.head_dim * self.k.element_size()

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def scrub(self, pages: Sequence[int]) -> None:
        """Zero the given pages in every layer (seal 6)."""
        idx = torch.as_tensor(list(pages), dtype=torch.long, device=self.k.device)
        self.k[:, idx] = 0
        self.v[:, idx] = 0

    def read_pages(self, pages: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V for `pages`: (L, n, S, KVH, D) each, whatever the layout."""
        idx = torch.as_tensor(list(pages), dtype=torch.long, device=self.k.device)
        k = self.k[:, idx]
        if self.layout == "kt":  # (L, n, KVH, D, S) -> (L, n, S, KVH, D)
            k = k.permute(0, 1, 4, 2, 3)
        return k.contiguous(), self.v[:, idx].clone()

    def write_pages(self, pages: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V given as (L, n, S, KVH, D) each into `pages`, whatever the layout."""
        idx = torch.as_tensor(list(pages), dtype=torch.long, device=self.k.device)
        if self.layout == "kt":
            k = k.permute(0, 1, 3, 4, 2)
        self.k[:, idx] = k.to(self.k.device, self.k.dtype)
        self.v[:, idx] = v.to(self.v.device, self.v.dtype)

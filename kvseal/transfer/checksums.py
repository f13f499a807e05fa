"""A handoff's checksums (seal 4): one unsigned 64-bit hash per page over its K bytes then its V bytes, and one over
the first token and its logprobs. Prefill computes them into the manifest (transfer/manifest.py); decode computes
them again over what arrived (transfer/verify.py) before a byte is used.

A page's bytes are hashed wherever they lie, with the same result: packed (a staged copy, page-major, page j at bytes
`[j * step, (j + 1) * step)` of each side) or in a pool (L, P, S, KVH, D), where page p is one block of
`S * KVH * D * element_size` bytes in each of the L layers.

Checksums are integrity checks (a flipped bit, a truncated or misrouted page), not authentication: identity is bound
by the reservation id and nonce, which only the decode worker and the router know.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec
import torch

try:
    import xxhash

    _HAVE_XXHASH = True
except ImportError:  # pragma: no cover - xxhash is a dependency; blake2b keeps a bare install working
    _HAVE_XXHASH = False


class _Hash(Protocol):  # the part of hashlib / xxhash hash objects used here
    def update(self, data: memoryview, /) -> None: ...
    def digest(self) -> bytes: ...


def _hasher() -> tuple[str, Callable[[], _Hash]]:
    if _HAVE_XXHASH:
        return "xxh3_64", xxhash.xxh3_64
    return "blake2b_64", lambda: hashlib.blake2b(digest_size=8)


# Both sides must use the same algorithm; its name travels in the manifest and verify() compares it.
CHECKSUM_ALGO, _new_hash = _hasher()


def packed_checksums(k: torch.Tensor, v: torch.Tensor, num_pages: int) -> list[int]:
    """Per page of a packed copy: k and v are 1-D uint8 CPU tensors of `num_pages` equal pages each."""
    n = num_pages
    if k.numel() != v.numel() or (n and k.numel() % n) or (not n and k.numel() + v.numel()):
        raise ValueError(f"payload of {k.numel()} + {v.numel()} bytes is not {n} equal pages")
    if n == 0:
        return []
    step = k.numel() // n
    kb, vb = k.numpy().data, v.numpy().data  # zero-copy byte views
    out = []
    for j in range(n):
        h = _new_hash()
        h.update(kb[j * step:(j + 1) * step])
        h.update(vb[j * step:(j + 1) * step])
        out.append(int.from_bytes(h.digest(), "big"))
    return out


def pool_checksums(k: torch.Tensor, v: torch.Tensor, page_ids: Sequence[int]) -> list[int]:
    """Per page, the same hash packed_checksums() gives for `page_ids` of the pools k, v packed (K's L blocks, then
    V's), read where they lie."""
    check_pools(k, v)
    num_layers, num_pages = k.shape[0], k.shape[1]
    if any(not 0 <= p < num_pages for p in page_ids):
        raise ValueError(f"page ids {list(page_ids)} out of range for a pool of {num_pages} pages")
    block = k.numel() // (num_layers * num_pages) * k.element_size() if num_pages else 0  # a page of a layer
    kb, vb = _flat_bytes(k), _flat_bytes(v)
    stride = num_pages * block
    out = []
    for p in page_ids:
        h = _new_hash()
        for mv in (kb, vb):
            for off in range(p * block, num_layers * stride, stride):
                h.update(mv[off:off + block])
        out.append(int.from_bytes(h.digest(), "big"))
    return out


def first_token_checksum(first_token: int, first_logprob: float | None,
                         first_top: Sequence[tuple[int, float]]) -> int:
    """One unsigned 64-bit hash over the first token and its logprobs, as they travel (msgpack)."""
    h = _new_hash()
    h.update(memoryview(msgspec.msgpack.encode([first_token, first_logprob, [list(t) for t in first_top]])))
    return int.from_bytes(h.digest(), "big")


def check_pools(k: torch.Tensor, v: torch.Tensor) -> None:
    """K and V pools a page can be read from or written into: contiguous (L, P, ...) of one dtype and page size."""
    # The layout inside a page is the workers' business (kv_layout, checked by the fleet check and verify());
    # here a page is a block of (S * KVH * D) elements of one dtype per layer, on both sides.
    if (k.dim() != 5 or v.dim() != 5 or k.dtype != v.dtype or k.shape[:2] != v.shape[:2]
            or k[0, 0].numel() != v[0, 0].numel() or not (k.is_contiguous() and v.is_contiguous())):
        raise ValueError(f"K and V pools must be contiguous (L, P, ...) tensors of one dtype and page size, "
                         f"got {tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}")


def _flat_bytes(pool: torch.Tensor) -> memoryview:
    if pool.device.type != "cpu":
        pool = pool.cpu()
    return pool.reshape(-1).view(torch.uint8).numpy().data.cast("B")

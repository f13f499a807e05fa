"""What a NIXL offer says, and every check of it that runs before the receiver claims a page.

An offer names prefill's agent (and the partial metadata that lets decode reach its export window, see
nixl_window.py), the window's geometry (where its K and V regions lie, how many pages, how large a (layer, page)
block is) and which window pages hold the request's KV. Every field is a number a peer chose: `check_offer` holds
each one to the reader's own geometry and to what fits in a 64-bit address space before the claim, so a
malformed or hostile offer is refused while the reservation is still untouched, and nothing computed from it later
(descriptor lists, rows) can overflow or point outside the window it describes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from kvseal.transfer.manifest import SCHEMA_VERSION, KVManifest, page_nbytes

ADDRESS_SPACE = 2**64  # a region [addr, addr + span) must end at or below this
MAX_PAGES = 2**31 - 1  # page ids become int32 descriptor rows (Geometry.rows)
MAX_AGENT_NAME = 256
MAX_READABLE_S = 24 * 3600.0


class NixlOffer(msgspec.Struct, frozen=True, kw_only=True):
    agent: str  # prefill's NIXL agent name (unique per process)
    metadata: bytes  # partial agent metadata: connection info + this receiver's export window only
    k_addr: int  # the window's K and V regions (NIXL checks every read against the registered window)
    v_addr: int
    layers: int
    pool_pages: int  # pages in the window: page ids are checked against it before any read
    block_bytes: int  # bytes of one (layer, page) block; must equal the reader's
    page_ids: list[int]  # window pages holding the request's KV, in token order
    readable_s: float  # prefill's transfer timeout; decode gives up waiting for the read at half of it
    v: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class Geometry:
    """Two registered regions (K, V) of `layers` x `pages` blocks of `block` bytes: a pool (L, P, S, KVH, D)."""

    k_ptr: int
    v_ptr: int
    layers: int
    pages: int
    block: int  # bytes of one (layer, page) block

    @property
    def span(self) -> int:
        return self.layers * self.pages * self.block

    def blocks(self) -> np.ndarray:
        """(2 * L * P, 3) descriptors (address, length, device 0); row s*L*P + l*P + p is block (side, l, p)."""
        lp = np.arange(self.layers * self.pages, dtype=np.uint64) * np.uint64(self.block)
        addr = np.concatenate([lp + np.uint64(self.k_ptr), lp + np.uint64(self.v_ptr)])
        out = np.zeros((addr.size, 3), dtype=np.uint64)
        out[:, 0], out[:, 1] = addr, self.block
        return out

    def rows(self, page_ids: Sequence[int]) -> np.ndarray:
        """Descriptor rows of the pages' blocks in (side, layer, page) order: runs of adjacent pages stay
        adjacent, so NIXL can merge them into one larger read."""
        pages = np.asarray(page_ids, dtype=np.int64)
        per_layer = np.arange(2 * self.layers, dtype=np.int64)[:, None] * self.pages
        return (per_layer + pages[None, :]).reshape(-1).astype(np.int32)


def geometry(k: torch.Tensor, v: torch.Tensor) -> Geometry:
    if k.device.type != "cpu" or v.device.type != "cpu" or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("NixlTransport registers contiguous CPU pools (L, P, ...) only")
    layers, pages = int(k.shape[0]), int(k.shape[1])
    return Geometry(k.data_ptr(), v.data_ptr(), layers, pages, page_nbytes(k) // max(layers, 1))


def offered(offer: NixlOffer) -> Geometry:
    return Geometry(offer.k_addr, offer.v_addr, offer.layers, offer.pool_pages, offer.block_bytes)


def check_offer(offer: NixlOffer, manifest: KVManifest, reader: Geometry) -> list[str]:
    """What is wrong with the offer (empty: nothing), from its fields alone and the reader's own geometry.
    Runs before the claim; reads no KV byte and loads no metadata."""
    bad: list[str] = []
    if offer.v != SCHEMA_VERSION:
        bad.append(f"schema v{offer.v} (this worker speaks v{SCHEMA_VERSION})")
    if not 0 < len(offer.agent) <= MAX_AGENT_NAME:
        bad.append(f"agent name of {len(offer.agent)} characters (1 to {MAX_AGENT_NAME})")
    if not offer.metadata:
        bad.append("no agent metadata")
    if offer.layers != reader.layers:
        bad.append(f"layers {offer.layers} (this pool has {reader.layers})")
    if offer.block_bytes != reader.block:
        bad.append(f"block_bytes {offer.block_bytes} (this pool's (layer, page) block is {reader.block})")
    if not 1 <= offer.pool_pages <= MAX_PAGES:
        bad.append(f"pool_pages {offer.pool_pages} (1 to {MAX_PAGES})")
    if bad:  # the span below needs sane layers, block and pages
        return bad
    span = offered(offer).span
    for name, addr in (("k_addr", offer.k_addr), ("v_addr", offer.v_addr)):
        if not 0 < addr <= ADDRESS_SPACE - span:
            bad.append(f"{name} {addr:#x}: a region of {span} bytes there does not fit a 64-bit address space")
    if not bad and abs(offer.k_addr - offer.v_addr) < span:
        bad.append(f"k_addr {offer.k_addr:#x} and v_addr {offer.v_addr:#x} overlap ({span} bytes each)")
    if len(offer.page_ids) != manifest.num_pages:
        bad.append(f"{len(offer.page_ids)} page ids for a manifest of {manifest.num_pages} pages")
    outside = [p for p in offer.page_ids if not 0 <= p < offer.pool_pages]
    if outside:
        bad.append(f"page ids {outside[:4]} outside [0, {offer.pool_pages})")
    if len(set(offer.page_ids)) != len(offer.page_ids):
        bad.append("a page id offered twice")
    if not (math.isfinite(offer.readable_s) and 0 < offer.readable_s <= MAX_READABLE_S):
        bad.append(f"readable_s {offer.readable_s} (a positive number of seconds up to {MAX_READABLE_S:g})")
    return bad

"""What moves in a prefill -> decode handoff, and its check before use (seal 4). Transport-independent.

Decode reserves pages and hands out a `Reservation`; prefill describes its pages with a `KVManifest` (checksums
computed over its pool pages in place, `PoolPages`) and a transport moves them: either packed into a
`PagePayload` (ZeroMQ), which decode verifies and only then unpacks into its reserved pages (`unpack_into`), or
straight into the reserved pages (NIXL), which decode claims first (`verify_identity`: nothing lands in a page
unless the manifest names its reservation) and verifies in place (`PoolPages`) before the request may use them.
The checks are in transfer/verify.py, the checksums in transfer/checksums.py.

Payload layout: per side (K, V) one contiguous byte buffer, page-major `(n, L, S, KVH, D)`, so page j of the
transfer is bytes `[j * page_bytes, (j + 1) * page_bytes)` of each side, where `page_bytes = L * S * KVH * D *
element_size` (see `page_nbytes`). Bytes are moved raw, so every dtype (bfloat16 included) round-trips exactly.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch

from kvseal.transfer.checksums import (
    CHECKSUM_ALGO,
    check_pools,
    first_token_checksum,
    packed_checksums,
    pool_checksums,
)
from kvseal.wire.kvspec import KVSpec
from kvseal.wire.reservation import SCHEMA_VERSION, Reservation


class KVManifest(msgspec.Struct, frozen=True, kw_only=True):
    """What prefill claims to have sent. `kv` describes *prefill's* KV, never copied from the reservation, so
    that verify() compares the two workers' views."""

    request_id: str
    reservation_id: str
    nonce: str
    num_tokens: int
    num_pages: int
    page_checksums: list[int]  # one unsigned 64-bit hash per page over its K bytes then its V bytes
    checksum: str  # the algorithm, CHECKSUM_ALGO on the sender
    first_token: int  # sampled by prefill
    first_logprob: float | None = None
    first_top: list[tuple[int, float]] = []  # top-k alternatives of the first token, best first
    first_checksum: int = 0  # over first_token, first_logprob and first_top (see first_token_checksum)
    kv: KVSpec  # prefill's own KV spec
    v: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class PagePayload:
    """K and V bytes of `num_pages` pages, page-major; each side a 1-D contiguous uint8 CPU tensor."""

    k: torch.Tensor  # (num_pages * page_bytes,) uint8
    v: torch.Tensor  # (num_pages * page_bytes,) uint8
    num_pages: int

    @property
    def nbytes(self) -> int:
        return self.k.numel() + self.v.numel()

    @staticmethod
    def from_buffers(k: memoryview | bytes, v: memoryview | bytes, num_pages: int) -> PagePayload:
        """Wrap received buffers without copying. The tensors are read-only views: never write to them."""
        return PagePayload(_bytes_tensor(k), _bytes_tensor(v), num_pages)


@dataclass(frozen=True, slots=True)
class PoolPages:
    """`page_ids` of the pools k, v (L, P, ...) where they lie: the pages a transport reads from or writes into
    without a staging copy. Page j's bytes are pool_k[:, page_ids[j]] (L blocks) then the same of pool_v."""

    k: torch.Tensor
    v: torch.Tensor
    page_ids: tuple[int, ...]

    @property
    def num_pages(self) -> int:
        return len(self.page_ids)

    @property
    def nbytes(self) -> int:
        return 2 * self.num_pages * page_nbytes(self.k)

    def checksums(self) -> list[int]:
        """Per page, the same hash as the PagePayload of these pages packed."""
        return pool_checksums(self.k, self.v, self.page_ids)

    def pack(self) -> PagePayload:
        return pack_pages(self.k, self.v, self.page_ids)


def _bytes_tensor(buf: memoryview | bytes) -> torch.Tensor:
    mv = memoryview(buf).cast("B")
    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if mv.readonly:  # torch warns on read-only buffers; these are only ever read (hash, copy out)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(mv, dtype=torch.uint8)
    return torch.frombuffer(mv, dtype=torch.uint8)


# -- naming and sizes ---------------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def page_nbytes(pool: torch.Tensor) -> int:
    """Bytes of one page of one side: L * S * KVH * D * element_size, for a pool (L, P, S, KVH, D)."""
    return pool.numel() // pool.shape[1] * pool.element_size() if pool.shape[1] else 0


def build_manifest(reservation: Reservation, payload: PagePayload | PoolPages, *, num_tokens: int, first_token: int,
                   kv: KVSpec, first_logprob: float | None = None,
                   first_top: Sequence[tuple[int, float]] = ()) -> KVManifest:
    """Prefill's manifest: identity from the reservation, everything else (`kv` included) from prefill's own
    state."""
    return KVManifest(
        request_id=reservation.request_id, reservation_id=reservation.reservation_id,
        nonce=reservation.nonce, num_tokens=num_tokens, num_pages=payload.num_pages,
        page_checksums=payload.checksums() if isinstance(payload, PoolPages) else page_checksums(payload),
        checksum=CHECKSUM_ALGO, first_token=first_token,
        first_logprob=first_logprob, first_top=list(first_top),
        first_checksum=first_token_checksum(first_token, first_logprob, first_top),
        kv=kv,
    )


# -- moving pages -------------------------------------------------------------------------------------


def _rows(pool: torch.Tensor, pages: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool as a (L * P, W) matrix of machine words, and the row of each (page, layer), page-major.

    Indexing whole rows of the widest word that divides a row is ~10x faster than byte-wise indexing.
    """
    num_layers, num_pages = pool.shape[0], pool.shape[1]
    rows = pool.reshape(num_layers * num_pages, -1).view(torch.uint8)  # (L*P, B)
    rows = rows.view(_word(rows.shape[1], rows.data_ptr()))
    idx = torch.as_tensor(list(pages), dtype=torch.long, device=pool.device)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_pages):
        raise ValueError(f"page ids {list(pages)} out of range for a pool of {num_pages} pages")
    layer_base = torch.arange(num_layers, device=pool.device) * num_pages
    return rows, (idx[:, None] + layer_base[None, :]).reshape(-1)  # (n * L,)


def _word(nbytes: int, ptr: int) -> torch.dtype:
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if nbytes % size == 0 and ptr % size == 0:
            return dtype
    return torch.uint8


def pack_pages(k: torch.Tensor, v: torch.Tensor, pages: Sequence[int]) -> PagePayload:
    """Gather `pages` of the pools k, v (L, P, S, KVH, D) into one page-major CPU buffer per side."""
    check_pools(k, v)

    def side(pool: torch.Tensor) -> torch.Tensor:
        rows, sel = _rows(pool, pages)
        packed = torch.index_select(rows, 0, sel)  # (n * L, W): page-major, contiguous
        return packed.view(torch.uint8).reshape(-1).cpu()

    return PagePayload(side(k), side(v), len(pages))


def unpack_into(pool_k: torch.Tensor, pool_v: torch.Tensor, page_ids: Sequence[int],
                payload: PagePayload) -> None:
    """Write the payload's pages, in order, into `page_ids` of the pools. Call only after verify()."""
    check_pools(pool_k, pool_v)
    if len(set(page_ids)) != len(page_ids):
        raise ValueError(f"page ids must be distinct, got {list(page_ids)}")
    want = len(page_ids) * page_nbytes(pool_k)
    if payload.num_pages != len(page_ids) or payload.k.numel() != want or payload.v.numel() != want:
        raise ValueError(f"payload of {payload.num_pages} pages ({payload.k.numel()} + {payload.v.numel()} "
                         f"bytes) does not fit {len(page_ids)} pages of {page_nbytes(pool_k)} bytes per side")
    if not page_ids:
        return
    for pool, src in ((pool_k, payload.k), (pool_v, payload.v)):
        rows, sel = _rows(pool, page_ids)
        word = _word(rows.shape[1] * rows.element_size(), src.data_ptr())
        if word != rows.dtype:  # a misaligned receive buffer: realign once rather than copy bytewise
            src = src.clone()
        src_rows = src.view(rows.dtype).view(sel.numel(), -1).to(pool.device)
        rows.index_copy_(0, sel, src_rows)


# -- checksums ----------------------------------------------------------------------------------------


def page_checksums(payload: PagePayload) -> list[int]:
    """One unsigned 64-bit hash per page, over that page's K bytes then its V bytes."""
    return packed_checksums(payload.k, payload.v, payload.num_pages)

"""What moves in a prefill -> decode handoff, and its check before use (seal 4). Transport-independent.

Decode reserves pages and hands out a `Reservation`; prefill describes its pages with a `KVManifest` (checksums
computed over its pool pages in place, `PoolPages`) and a transport moves them: either packed into a
`PagePayload` (ZeroMQ), which decode runs `verify()` on and only then `unpack_into()` its reserved pages, or
straight into the reserved pages (NIXL), which decode claims first (`verify_identity`: nothing lands in a page
unless the manifest names its reservation) and checks in place (`verify_landed`) before the request may use them.

Payload layout: per side (K, V) one contiguous byte buffer, page-major `(n, L, S, KVH, D)`, so page j of the
transfer is bytes `[j * page_bytes, (j + 1) * page_bytes)` of each side, where `page_bytes = L * S * KVH * D *
element_size` (see `page_nbytes`). Bytes are moved raw, so every dtype (bfloat16 included) round-trips exactly.

Checksums are integrity checks (a flipped bit, a truncated or misrouted page), not authentication: identity is
bound by the reservation id and nonce, which only the decode worker and the router know.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec
import torch

from kvseal.errors import TransferVerificationFailed
from kvseal.kv.allocator import pages_for
from kvseal.kv.spec import KVSpec

try:
    import xxhash

    _HAVE_XXHASH = True
except ImportError:  # pragma: no cover - xxhash is a dependency; blake2b keeps a bare install working
    _HAVE_XXHASH = False

SCHEMA_VERSION = 1


class _Hash(Protocol):  # the part of hashlib / xxhash hash objects used here
    def update(self, data: memoryview, /) -> None: ...
    def digest(self) -> bytes: ...


def _hasher() -> tuple[str, Callable[[], _Hash]]:
    if _HAVE_XXHASH:
        return "xxh3_64", xxhash.xxh3_64
    return "blake2b_64", lambda: hashlib.blake2b(digest_size=8)


# Both sides must use the same algorithm; its name travels in the manifest and verify() compares it.
CHECKSUM_ALGO, _new_hash = _hasher()


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """Pages a decode worker set aside for one request. Decode keeps its own copy and verifies against it."""

    request_id: str
    reservation_id: str
    nonce: str  # 128-bit random hex; binds the arrival to this reservation (see new_nonce)
    num_tokens: int  # prompt tokens whose KV will arrive
    page_ids: list[int]  # decode's page ids, in token order; len == ceil(num_tokens / kv.page_size)
    kv: KVSpec  # decode's own KV spec: the manifest's must equal it (verify_identity)
    kv_endpoint: str  # where to send the pages, e.g. "tcp://127.0.0.1:5555"
    kv_key: str = ""  # the decode worker's fleet public key (Z85): prefill pins it; "" in a fleet without keys
    kv_session: str = ""  # decode's KV session (hex): the channel's MAC framing (transfer/kvmac.py); "": CURVE
    v: int = SCHEMA_VERSION


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
        """Per page, the same hash page_checksums() gives for these pages packed (K's L blocks, then V's)."""
        _check_pools(self.k, self.v)
        num_layers, num_pages = self.k.shape[0], self.k.shape[1]
        if any(not 0 <= p < num_pages for p in self.page_ids):
            raise ValueError(f"page ids {list(self.page_ids)} out of range for a pool of {num_pages} pages")
        block = page_nbytes(self.k) // num_layers if num_layers else 0
        kb, vb = _flat_bytes(self.k), _flat_bytes(self.v)
        stride = num_pages * block
        out = []
        for p in self.page_ids:
            h = _new_hash()
            for mv in (kb, vb):
                for off in range(p * block, num_layers * stride, stride):
                    h.update(mv[off:off + block])
            out.append(int.from_bytes(h.digest(), "big"))
        return out

    def pack(self) -> PagePayload:
        return pack_pages(self.k, self.v, self.page_ids)


def _flat_bytes(pool: torch.Tensor) -> memoryview:
    if pool.device.type != "cpu":
        pool = pool.cpu()
    return pool.reshape(-1).view(torch.uint8).numpy().data.cast("B")


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


def new_nonce() -> str:
    return secrets.token_hex(16)


def new_reservation_id() -> str:
    return secrets.token_hex(8)


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


def _check_pools(k: torch.Tensor, v: torch.Tensor) -> None:
    # The layout inside a page is the workers' business (kv_layout, checked by the fleet check and verify());
    # here a page is a block of (S * KVH * D) elements of one dtype per layer, on both sides.
    if (k.dim() != 5 or v.dim() != 5 or k.dtype != v.dtype or k.shape[:2] != v.shape[:2]
            or k[0, 0].numel() != v[0, 0].numel() or not (k.is_contiguous() and v.is_contiguous())):
        raise ValueError(f"K and V pools must be contiguous (L, P, ...) tensors of one dtype and page size, "
                         f"got {tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}")


def pack_pages(k: torch.Tensor, v: torch.Tensor, pages: Sequence[int]) -> PagePayload:
    """Gather `pages` of the pools k, v (L, P, S, KVH, D) into one page-major CPU buffer per side."""
    _check_pools(k, v)

    def side(pool: torch.Tensor) -> torch.Tensor:
        rows, sel = _rows(pool, pages)
        packed = torch.index_select(rows, 0, sel)  # (n * L, W): page-major, contiguous
        return packed.view(torch.uint8).reshape(-1).cpu()

    return PagePayload(side(k), side(v), len(pages))


def unpack_into(pool_k: torch.Tensor, pool_v: torch.Tensor, page_ids: Sequence[int],
                payload: PagePayload) -> None:
    """Write the payload's pages, in order, into `page_ids` of the pools. Call only after verify()."""
    _check_pools(pool_k, pool_v)
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


# -- checking -----------------------------------------------------------------------------------------


def page_checksums(payload: PagePayload) -> list[int]:
    """One unsigned 64-bit hash per page, over that page's K bytes then its V bytes."""
    n = payload.num_pages
    if payload.k.numel() != payload.v.numel() or (n and payload.k.numel() % n) or (not n and payload.nbytes):
        raise ValueError(f"payload of {payload.k.numel()} + {payload.v.numel()} bytes is not {n} equal pages")
    if n == 0:
        return []
    step = payload.k.numel() // n
    kb, vb = payload.k.numpy().data, payload.v.numpy().data  # zero-copy byte views
    out = []
    for j in range(n):
        h = _new_hash()
        h.update(kb[j * step:(j + 1) * step])
        h.update(vb[j * step:(j + 1) * step])
        out.append(int.from_bytes(h.digest(), "big"))
    return out


def first_token_checksum(first_token: int, first_logprob: float | None,
                         first_top: Sequence[tuple[int, float]]) -> int:
    """One unsigned 64-bit hash over the first token and its logprobs, as they travel (msgpack)."""
    h = _new_hash()
    h.update(memoryview(msgspec.msgpack.encode([first_token, first_logprob, [list(t) for t in first_top]])))
    return int.from_bytes(h.digest(), "big")


def _fail(manifest: KVManifest, field: str, expected: object, received: object) -> TransferVerificationFailed:
    err = TransferVerificationFailed(
        f"KV transfer for request {manifest.request_id!r} failed verification: {field}: "
        f"expected {expected!r}, received {received!r}; the request produces no output")
    err.field = field.split(" ")[0].split("[")[0]  # "page_checksums[3] (...)" -> "page_checksums"
    return err


def verify(manifest: KVManifest, reservation: Reservation, payload: PagePayload, *,
           expected_fingerprint: str, page_bytes: int, vocab_size: int | None = None,
           logprobs: int | None = None) -> None:
    """Raise TransferVerificationFailed unless the arrival is exactly what `reservation` set aside (seal 4).

    `expected_fingerprint` and `page_bytes` (see page_nbytes) describe the receiving worker's own model
    and pool. The first token and its logprobs must match their checksum; with `vocab_size` (the receiving
    model's) they are also range-checked against the request's `logprobs` (None: it asked for none), since
    decode emits that token and feeds it to the next step. Cheap checks first; the page checksums, which read
    every byte, last.
    """
    m = manifest
    verify_identity(m, reservation, expected_fingerprint=expected_fingerprint, vocab_size=vocab_size,
                    logprobs=logprobs)
    _same(m, "payload pages", m.num_pages, payload.num_pages)
    _same(m, "payload K bytes", m.num_pages * page_bytes, payload.k.numel())
    _same(m, "payload V bytes", m.num_pages * page_bytes, payload.v.numel())
    _check_sums(m, reservation, page_checksums(payload))


def verify_identity(manifest: KVManifest, reservation: Reservation, *, expected_fingerprint: str,
                    vocab_size: int | None = None, logprobs: int | None = None) -> None:
    """Every check of verify() that reads no KV byte: run it before a single byte may land in a reserved page
    (a transport that writes into the pages directly), so a manifest that does not name this reservation
    moves nothing."""
    m, r = manifest, reservation
    _same(m, "manifest schema version", SCHEMA_VERSION, m.v)
    verify_names(m, r)
    _same(m, "model_fingerprint (reservation vs this worker)", expected_fingerprint, r.kv.model_fingerprint)
    # every KVSpec field, in order (model_fingerprint, page_size, kv_dtype, kv_layout): the reservation's
    # fingerprint is this worker's (above), so the manifest's is compared with this worker's too
    differ = r.kv.differences(m.kv)
    if differ:
        raise _fail(m, *differ[0])
    _same(m, "checksum algorithm", CHECKSUM_ALGO, m.checksum)
    _same(m, "num_tokens", r.num_tokens, m.num_tokens)
    if m.num_tokens < 1:
        raise _fail(m, "num_tokens", "at least 1", m.num_tokens)
    _same(m, "num_pages (reserved pages)", len(r.page_ids), m.num_pages)
    _same(m, "num_pages (ceil(num_tokens / page_size))", pages_for(m.num_tokens, r.kv.page_size), m.num_pages)
    _same(m, "number of page_checksums", m.num_pages, len(m.page_checksums))
    _same(m, "first_checksum", first_token_checksum(m.first_token, m.first_logprob, m.first_top), m.first_checksum)
    if vocab_size is not None:
        _check_first_token(m, vocab_size, logprobs)


def verify_names(manifest: KVManifest, reservation: Reservation) -> None:
    """The arrival names this reservation: request id, reservation id and nonce. Whoever sends one that does not
    may not be the prefill worker the router chose, so the error says which field differs but never the
    reservation's value (a nack carries it back to the sender: it must not teach a forger the nonce)."""
    m, r = manifest, reservation
    _same(m, "request_id", r.request_id, m.request_id)
    for field, want, got in (("reservation_id", r.reservation_id, m.reservation_id), ("nonce", r.nonce, m.nonce)):
        if not hmac.compare_digest(want.encode(), got.encode()):
            err = TransferVerificationFailed(f"KV transfer for request {m.request_id!r} failed verification: "
                                             f"{field}: the arrival does not name this request's reservation")
            err.field = field
            raise err


def verify_landed(manifest: KVManifest, reservation: Reservation, landed: PoolPages) -> None:
    """The rest of verify() for bytes that landed in the reserved pages themselves: the page checksums, over
    the pages in place. Call after verify_identity() and once nothing can land in those pages any more."""
    _same(manifest, "landed pages", list(reservation.page_ids[: manifest.num_pages]), list(landed.page_ids))
    _check_sums(manifest, reservation, landed.checksums())


def _same(m: KVManifest, field: str, expected: object, received: object) -> None:
    if expected != received:
        raise _fail(m, field, expected, received)


def _check_sums(m: KVManifest, r: Reservation, got: list[int]) -> None:
    bad = [j for j, (a, b) in enumerate(zip(m.page_checksums, got, strict=True)) if a != b]
    if bad:
        j = bad[0]
        raise _fail(m, f"page_checksums[{j}] (reserved page {r.page_ids[j]}; {len(bad)} of {m.num_pages} "
                    f"pages differ)", f"{m.page_checksums[j]:#018x}", f"{got[j]:#018x}")


def _check_first_token(m: KVManifest, vocab_size: int, logprobs: int | None) -> None:
    def logprob_ok(x: float) -> bool:
        return math.isfinite(x) and x <= 1e-4  # a log-probability; a hair above 0 is float rounding

    if not 0 <= m.first_token < vocab_size:
        raise _fail(m, "first_token", f"a token id in [0, {vocab_size})", m.first_token)
    if logprobs is None:
        if m.first_logprob is not None or m.first_top:
            raise _fail(m, "first_logprob/first_top", "none (the request asked for no logprobs)",
                        (m.first_logprob, len(m.first_top)))
        return
    if m.first_logprob is None or not logprob_ok(m.first_logprob):
        raise _fail(m, "first_logprob", "a finite log-probability <= 0", m.first_logprob)
    want = min(logprobs, vocab_size)
    if len(m.first_top) != want:
        raise _fail(m, "len(first_top)", want, len(m.first_top))
    for tid, lp in m.first_top:
        if not 0 <= tid < vocab_size or not logprob_ok(lp):
            raise _fail(m, "first_top", f"token ids in [0, {vocab_size}) with finite log-probabilities <= 0",
                        (tid, lp))

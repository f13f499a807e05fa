"""The check of an arrived handoff before use (seal 4): the manifest against the reservation that set its pages aside,
field by field, then every page's checksum (transfer/manifest.py has what moves and how it is laid out,
transfer/checksums.py the checksums).

An arrival is checked by one call, `verify`, whether its pages came as a staged copy (`PagePayload`, checked before
a byte of it enters a reserved page) or landed in the reserved pages themselves (`PoolPages`, checked there before
the request may read them). A transport that writes into the reserved pages asks first (`verify_identity`): every
check that reads no KV byte, so that a manifest that does not name this reservation moves nothing; what landed is
then checked by `verify` for the rest.
"""

from __future__ import annotations

import hmac
import math

from kvseal.errors import TransferVerificationFailed
from kvseal.kv.allocator import pages_for
from kvseal.transfer.checksums import CHECKSUM_ALGO, first_token_checksum, packed_checksums, pool_checksums
from kvseal.transfer.manifest import SCHEMA_VERSION, KVManifest, PagePayload, PoolPages
from kvseal.wire.reservation import Reservation

# The fields that say which reservation an arrival is for. An arrival that differs in one of them does not name
# the reservation: whoever sent it may not be the prefill worker the router chose, and it must change nothing.
NAMES = frozenset({"request_id", "reservation_id", "nonce"})


def verify(manifest: KVManifest, reservation: Reservation, pages: PagePayload | PoolPages, *,
           expected_fingerprint: str, page_bytes: int, vocab_size: int | None = None,
           logprobs: int | None = None) -> None:
    """Raise TransferVerificationFailed unless the arrival is exactly what `reservation` set aside (seal 4).

    `expected_fingerprint` and `page_bytes` (see page_nbytes) describe the receiving worker's own model
    and pool. The first token and its logprobs must match their checksum; with `vocab_size` (the receiving
    model's) they are also range-checked against the request's `logprobs` (None: it asked for none), since
    decode emits that token and feeds it to the next step. Pages that landed in the reserved pages themselves
    (`PoolPages`) were claimed first: every check that reads no KV byte ran then (verify_identity, before a byte
    could land), and here the rest. Cheap checks first; the checksums, computed in one place, last.
    """
    m = manifest
    if isinstance(pages, PagePayload):
        _check_fields(m, reservation, expected_fingerprint, vocab_size, logprobs)
    _check_extent(m, reservation, pages, page_bytes)
    if isinstance(pages, PoolPages):
        sums = pool_checksums(pages.k, pages.v, pages.page_ids)
    else:
        first = first_token_checksum(m.first_token, m.first_logprob, m.first_top)
        sums = packed_checksums(pages.k, pages.v, pages.num_pages)
        _same(m, "first_checksum", first, m.first_checksum)
    _check_sums(m, reservation, sums)


def verify_identity(manifest: KVManifest, reservation: Reservation, *, expected_fingerprint: str,
                    vocab_size: int | None = None, logprobs: int | None = None) -> None:
    """Every check of verify() that reads no KV byte: run it before a single byte may land in a reserved page
    (a transport that writes into the pages directly), so a manifest that does not name this reservation
    moves nothing."""
    m = manifest
    _check_fields(m, reservation, expected_fingerprint, vocab_size, logprobs)
    _same(m, "first_checksum", first_token_checksum(m.first_token, m.first_logprob, m.first_top), m.first_checksum)


def _check_fields(m: KVManifest, r: Reservation, expected_fingerprint: str, vocab_size: int | None,
                  logprobs: int | None) -> None:
    """The manifest's fields against the reservation and this worker: no KV byte read, no checksum computed."""
    _same(m, "manifest schema version", SCHEMA_VERSION, m.v)
    _check_names(m, r)
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
    if vocab_size is not None:
        _check_first_token(m, vocab_size, logprobs)


def _check_names(m: KVManifest, r: Reservation) -> None:
    """The arrival names this reservation: request id, reservation id and nonce (NAMES). The error says which field
    differs but never the reservation's value (a nack carries it back to the sender: it must not teach a forger the
    nonce)."""
    _same(m, "request_id", r.request_id, m.request_id)
    for field, want, got in (("reservation_id", r.reservation_id, m.reservation_id), ("nonce", r.nonce, m.nonce)):
        if not hmac.compare_digest(want.encode(), got.encode()):
            err = TransferVerificationFailed(f"KV transfer for request {m.request_id!r} failed verification: "
                                             f"{field}: the arrival does not name this request's reservation")
            err.field = field
            raise err


def _check_extent(m: KVManifest, r: Reservation, pages: PagePayload | PoolPages, page_bytes: int) -> None:
    """What arrived is the manifest's pages: a staged copy of exactly their bytes, or the reserved pages
    themselves."""
    if isinstance(pages, PoolPages):
        _same(m, "landed pages", list(r.page_ids[: m.num_pages]), list(pages.page_ids))
        return
    _same(m, "payload pages", m.num_pages, pages.num_pages)
    _same(m, "payload K bytes", m.num_pages * page_bytes, pages.k.numel())
    _same(m, "payload V bytes", m.num_pages * page_bytes, pages.v.numel())


def _fail(manifest: KVManifest, field: str, expected: object, received: object) -> TransferVerificationFailed:
    err = TransferVerificationFailed(
        f"KV transfer for request {manifest.request_id!r} failed verification: {field}: "
        f"expected {expected!r}, received {received!r}; the request produces no output")
    err.field = field.split(" ")[0].split("[")[0]  # "page_checksums[3] (...)" -> "page_checksums"
    return err


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

"""The handoff manifest: packing pages, checksums, and verification before use (seal 4). Pure, no sockets."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvseal.errors import TransferVerificationFailed
from kvseal.transfer.manifest import (
    CHECKSUM_ALGO,
    KVManifest,
    PagePayload,
    build_manifest,
    dtype_name,
    pack_pages,
    page_checksums,
    page_nbytes,
    unpack_into,
)
from kvseal.transfer.verify import verify
from kvseal.wire.kvspec import KVSpec
from kvseal.wire.reservation import Reservation, new_nonce, new_reservation_id

L, P, S, KVH, D = 3, 12, 4, 2, 8
FP = "fp-tiny-1"
LAYOUT = f"L{L}xPxSx{KVH}x{D}"
PREFILL_PAGES = [7, 0, 11]
DECODE_PAGES = [9, 2, 5]
NUM_TOKENS = 10  # ceil(10 / 4) == 3 pages


def pools(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, P, S, KVH, D, generator=g).to(dtype)
    return k, torch.randn(L, P, S, KVH, D, generator=g).to(dtype)


def reservation(dtype: torch.dtype = torch.float32) -> Reservation:
    return Reservation(request_id="req-1", reservation_id=new_reservation_id(), nonce=new_nonce(),
                       num_tokens=NUM_TOKENS, page_ids=DECODE_PAGES, kv=KVSpec(model_fingerprint=FP, page_size=S,
                       kv_dtype=dtype_name(dtype), kv_layout=LAYOUT), kv_endpoint="tcp://127.0.0.1:1")


def handoff(dtype: torch.dtype = torch.float32) -> tuple[Reservation, KVManifest, PagePayload]:
    k, v = pools(dtype)
    res = reservation(dtype)
    payload = pack_pages(k, v, PREFILL_PAGES)
    man = build_manifest(res, payload, num_tokens=NUM_TOKENS, first_token=42, first_logprob=-0.25,
                         first_top=[(42, -0.25), (7, -1.5)], kv=KVSpec(model_fingerprint=FP, page_size=S,
                         kv_dtype=dtype_name(dtype), kv_layout=LAYOUT))
    return res, man, payload


def check(man: KVManifest, res: Reservation, payload: PagePayload, dtype: torch.dtype = torch.float32) -> None:
    verify(man, res, payload, expected_fingerprint=FP, page_bytes=page_nbytes(pools(dtype)[0]))


def over_the_wire(payload: PagePayload) -> PagePayload:
    """What a receiver sees: read-only byte buffers."""
    return PagePayload.from_buffers(bytes(payload.k.numpy()), bytes(payload.v.numpy()), payload.num_pages)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_unpack_round_trip_moves_exact_bytes(dtype: torch.dtype) -> None:
    k, v = pools(dtype)
    payload = over_the_wire(pack_pages(k, v, PREFILL_PAGES))
    assert payload.nbytes == 2 * len(PREFILL_PAGES) * page_nbytes(k)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    unpack_into(dk, dv, DECODE_PAGES, payload)
    for src, dst in zip(PREFILL_PAGES, DECODE_PAGES, strict=True):
        assert torch.equal(dk[:, dst].view(torch.uint8), k[:, src].view(torch.uint8))
        assert torch.equal(dv[:, dst].view(torch.uint8), v[:, src].view(torch.uint8))
    untouched = [p for p in range(P) if p not in DECODE_PAGES]
    assert not dk[:, untouched].any() and not dv[:, untouched].any()


def test_payload_is_page_major_and_contiguous() -> None:
    k, v = pools(torch.float32)
    payload = pack_pages(k, v, PREFILL_PAGES)
    assert payload.k.is_contiguous() and payload.k.dtype == torch.uint8
    pages = payload.k.view(torch.float32).view(len(PREFILL_PAGES), L, S, KVH, D)
    assert torch.equal(pages, k[:, PREFILL_PAGES].transpose(0, 1))


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(1, 3), num_pages=st.integers(1, 9), page_size=st.sampled_from([1, 2, 4]),
       heads=st.integers(1, 3), head_dim=st.sampled_from([1, 3, 8]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.uint8]), data=st.data())
def test_round_trip_any_shape(layers: int, num_pages: int, page_size: int, heads: int, head_dim: int,
                              dtype: torch.dtype, data: st.DataObject) -> None:
    shape = (layers, num_pages, page_size, heads, head_dim)
    k = torch.randint(0, 255, (*shape[:-1], head_dim * torch.empty((), dtype=dtype).element_size()),
                      dtype=torch.uint8).view(dtype)
    v = k.flip(0).contiguous()
    n = data.draw(st.integers(0, num_pages))
    src = data.draw(st.permutations(range(num_pages)))[:n]
    dst = data.draw(st.permutations(range(num_pages)))[:n]
    payload = over_the_wire(pack_pages(k, v, src))
    assert len(page_checksums(payload)) == n
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    unpack_into(dk, dv, dst, payload)
    for got, want in ((dk, k), (dv, v)):  # compare bytes: random bytes may spell NaN
        assert torch.equal(got.view(torch.uint8)[:, dst], want.view(torch.uint8)[:, src])
        assert not got.view(torch.uint8)[:, [p for p in range(num_pages) if p not in dst]].any()


def test_checksums_are_per_page_64_bit_and_cover_k_and_v() -> None:
    _, man, payload = handoff()
    sums = page_checksums(payload)
    assert sums == man.page_checksums and len(sums) == 3 and len(set(sums)) == 3
    assert all(0 <= s < 2**64 for s in sums)
    assert man.checksum == CHECKSUM_ALGO
    for side in ("k", "v"):
        bad = flip_byte(payload, page=2, side=side)
        assert page_checksums(bad)[:2] == sums[:2] and page_checksums(bad)[2] != sums[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_accepts_the_genuine_handoff(dtype: torch.dtype) -> None:
    res, man, payload = handoff(dtype)
    check(man, res, over_the_wire(payload), dtype)


def test_manifest_and_reservation_survive_msgpack() -> None:
    res, man, _ = handoff()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(man), type=KVManifest) == man
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(res), type=Reservation) == res
    assert len(res.nonce) == 32 and int(res.nonce, 16) >= 0 and new_nonce() != new_nonce()


def flip_byte(payload: PagePayload, page: int, side: str = "v") -> PagePayload:
    k, v = payload.k.clone(), payload.v.clone()
    buf = k if side == "k" else v
    buf[page * (buf.numel() // payload.num_pages) + 5] ^= 0x10
    return PagePayload(k, v, payload.num_pages)


def fewer_pages(man: KVManifest, payload: PagePayload) -> tuple[KVManifest, PagePayload]:
    step = payload.k.numel() // payload.num_pages
    cut = PagePayload(payload.k[: 2 * step], payload.v[: 2 * step], 2)
    return msgspec.structs.replace(man, num_pages=2, page_checksums=man.page_checksums[:2]), cut


def field(**changes: object) -> Callable[[KVManifest, PagePayload], tuple[KVManifest, PagePayload]]:
    return lambda m, p: (msgspec.structs.replace(m, **changes), p)


def kv_field(**changes: object) -> Callable[[KVManifest, PagePayload], tuple[KVManifest, PagePayload]]:
    """The manifest claims another KV spec (prefill's own view of its KV)."""
    return lambda m, p: (msgspec.structs.replace(m, kv=msgspec.structs.replace(m.kv, **changes)), p)


Tamper = Callable[[KVManifest, PagePayload], tuple[KVManifest, PagePayload]]

TAMPERS: list[tuple[str, Tamper, str]] = [
    ("wrong request id", field(request_id="req-2"), "request_id: expected 'req-1', received 'req-2'"),
    ("wrong reservation id", field(reservation_id="r-other"), "reservation_id"),
    ("wrong nonce", field(nonce="0" * 32), "nonce"),
    ("fewer tokens", field(num_tokens=NUM_TOKENS - 1), f"num_tokens: expected {NUM_TOKENS}, received 9"),
    ("fewer pages", fewer_pages, "num_pages (reserved pages): expected 3, received 2"),
    ("flipped byte", lambda m, p: (m, flip_byte(p, page=1)), "page_checksums[1] (reserved page 2;"),
    ("wrong fingerprint", kv_field(model_fingerprint="fp-other"), "model_fingerprint: expected 'fp-tiny-1'"),
    ("wrong page size", kv_field(page_size=8), "page_size: expected 4, received 8"),
    ("wrong kv dtype", kv_field(kv_dtype="bfloat16"), "kv_dtype: expected 'float32', received 'bfloat16'"),
    ("wrong kv layout", kv_field(kv_layout="L3xPxSx1x16"), "kv_layout"),
    ("other checksum algorithm", field(checksum="crc32"), "checksum algorithm"),
    ("newer schema", field(v=2), "manifest schema version: expected 1, received 2"),
    ("missing checksums", field(page_checksums=[1, 2]), "number of page_checksums"),
    ("truncated payload", lambda m, p: (m, PagePayload(p.k[:-4], p.v, p.num_pages)), "payload K bytes"),
    ("pages in the wrong order", lambda m, p: (field(page_checksums=m.page_checksums[::-1])(m, p)),
     "page_checksums[0]"),
]


@pytest.mark.parametrize(("tamper", "needle"), [(t, n) for _, t, n in TAMPERS], ids=[i for i, _, _ in TAMPERS])
def test_verify_refuses_each_mismatch(tamper: Tamper, needle: str) -> None:
    res, man, payload = handoff()
    bad_man, bad_payload = tamper(man, over_the_wire(payload))
    with pytest.raises(TransferVerificationFailed) as exc:
        check(bad_man, res, bad_payload)
    assert needle in str(exc.value)
    assert exc.value.status == 502 and exc.value.code == "kv_verification_failed"


def test_verify_refuses_a_reservation_for_another_model() -> None:
    res, man, payload = handoff()
    with pytest.raises(TransferVerificationFailed, match="reservation vs this worker"):
        verify(man, res, payload, expected_fingerprint="fp-other", page_bytes=page_nbytes(pools(torch.float32)[0]))


def test_cheap_checks_run_before_the_checksums() -> None:
    res, man, payload = handoff()
    with pytest.raises(TransferVerificationFailed, match="nonce"):
        check(msgspec.structs.replace(man, nonce="f" * 32), res, flip_byte(payload, page=0))


def test_unpack_refuses_payloads_that_do_not_fit() -> None:
    k, v = pools(torch.float32)
    payload = pack_pages(k, v, PREFILL_PAGES)
    with pytest.raises(ValueError, match="distinct"):
        unpack_into(k.clone(), v.clone(), [1, 1, 2], payload)
    with pytest.raises(ValueError, match="does not fit"):
        unpack_into(k.clone(), v.clone(), [1, 2], payload)
    with pytest.raises(ValueError, match="out of range"):
        pack_pages(k, v, [0, P])

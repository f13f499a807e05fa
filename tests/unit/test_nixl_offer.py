"""Every field of a NIXL offer is range-checked before decode claims a page (transfer/nixl_offer.py): each field out
of range is named, a good offer passes, and the descriptor lists computed from a checked offer stay inside it."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvseal.transfer.manifest import KVManifest
from kvseal.transfer.nixl_offer import ADDRESS_SPACE, MAX_PAGES, Geometry, NixlOffer, check_offer, offered
from kvseal.wire.kvspec import KVSpec

READER = Geometry(k_ptr=0x10000, v_ptr=0x90000, layers=3, pages=16, block=256)
MANIFEST = KVManifest(request_id="r", reservation_id="x", nonce="0" * 32, num_tokens=9, num_pages=3,
                      page_checksums=[0, 0, 0], checksum="xxh3_64", first_token=1, kv=KVSpec(model_fingerprint="fp",
                      page_size=4, kv_dtype="bfloat16", kv_layout="L"))
GOOD = NixlOffer(agent="kvseal-prefill", metadata=b"md", k_addr=0x7F0000000000, v_addr=0x7F0001000000, layers=3,
                 pool_pages=32, block_bytes=256, page_ids=[4, 5, 31], readable_s=60.0)
SPAN = 3 * 32 * 256

BAD = {  # field -> (a value out of range, words the refusal must contain)
    "v": (2, "schema v2"),
    "agent": ("", "agent name"),
    "metadata": (b"", "no agent metadata"),
    "layers": (4, "layers 4"),
    "block_bytes": (512, "block_bytes 512"),
    "pool_pages": (0, "pool_pages 0"),
    "k_addr": (-4096, "k_addr"),
    "v_addr": (ADDRESS_SPACE - SPAN + 1, "v_addr"),
    "page_ids": ([4, 5], "2 page ids for a manifest of 3 pages"),
    "readable_s": (float("nan"), "readable_s nan"),
}


def test_a_good_offer_passes_and_its_descriptors_stay_inside_the_window() -> None:
    assert check_offer(GOOD, MANIFEST, READER) == []
    geo = offered(GOOD)
    blocks = geo.blocks()
    rows = geo.rows(GOOD.page_ids)
    assert blocks.shape == (2 * 3 * 32, 3) and rows.max() < len(blocks)
    addr = blocks[rows, 0]
    in_k = (addr >= GOOD.k_addr) & (addr + 256 <= GOOD.k_addr + SPAN)
    in_v = (addr >= GOOD.v_addr) & (addr + 256 <= GOOD.v_addr + SPAN)
    assert np.all(in_k | in_v)


@pytest.mark.parametrize("field", sorted(BAD))
def test_each_field_out_of_range_is_named(field: str) -> None:
    value, words = BAD[field]
    bad = check_offer(msgspec.structs.replace(GOOD, **{field: value}), MANIFEST, READER)
    assert bad and words in "; ".join(bad), bad


@pytest.mark.parametrize(("field", "value", "words"), [
    ("pool_pages", MAX_PAGES + 1, "pool_pages"),
    ("page_ids", [4, 5, 32], "outside [0, 32)"),
    ("page_ids", [4, -1, 5], "outside [0, 32)"),
    ("page_ids", [4, 4, 5], "offered twice"),
    ("k_addr", 0, "k_addr 0x0"),
    ("k_addr", ADDRESS_SPACE - 1, "does not fit a 64-bit address space"),
    ("v_addr", 0x7F0000000000 + SPAN - 1, "overlap"),
    ("readable_s", -1.0, "readable_s -1.0"),
    ("readable_s", float("inf"), "readable_s inf"),
    ("agent", "a" * 257, "agent name of 257"),
])
def test_edges(field: str, value: object, words: str) -> None:
    bad = check_offer(msgspec.structs.replace(GOOD, **{field: value}), MANIFEST, READER)
    assert any(words in b for b in bad), bad


def test_the_last_address_that_fits_passes() -> None:
    top = msgspec.structs.replace(GOOD, k_addr=ADDRESS_SPACE - SPAN, v_addr=ADDRESS_SPACE - 2 * SPAN)
    assert check_offer(top, MANIFEST, READER) == []
    assert int(offered(top).blocks()[:, 0].max()) + 256 == ADDRESS_SPACE  # no wrap-around

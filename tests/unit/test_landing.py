"""The decode engine's side of an in-place transport (NIXL), on the real engines with a tiny model: a claim checks
the manifest's identity before a byte may land and then pins the reserved pages; a request that ends while
bytes may be landing (released, aborted, expired, fail_all) ends at once, but its pages stay owned until the
landing is over, and only then are they scrubbed and freed; what landed is verified in place before use (seal 4).
The bytes are written into the pages here by hand, as the transport would."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvseal.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvseal.errors import RequestAborted, TransferTimeout, TransferVerificationFailed, WorkerFailed
from kvseal.lifecycle import State
from kvseal.transfer.manifest import KVManifest, PoolPages
from kvseal.wire.messages import GenerateRequest, SamplingParams
from kvseal.wire.reservation import Reservation
from tests.helpers.halves import DecodeHalf, PrefillHalf, decode_engine, prefill_engine

from .conftest import tiny_checkpoint

CK = tiny_checkpoint()


def _engines() -> tuple[PrefillHalf, DecodeHalf]:
    cfg = EngineConfig(model=ModelConfig(max_model_len=128), cache=CacheConfig(page_size=4, pool_tokens=256),
                       scheduler=SchedulerConfig(max_num_batched_tokens=32))
    return prefill_engine(cfg, CK), decode_engine(cfg, CK)


def _offer(p: PrefillHalf, d: DecodeHalf, rid: str) -> tuple[KVManifest, PoolPages, Reservation]:
    ids = torch.randint(2, 64, (9,), generator=torch.Generator().manual_seed(len(rid))).tolist()
    req = GenerateRequest(rid, ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    res = d.kv.reserve(req, timeout_s=60.0, kv_endpoint="tcp://test")
    p.add_request(req)
    while not (ready := p.kv.take_ready()):
        p.step()
    manifest, src = p.kv.package(ready[0], res, staged=False)
    assert isinstance(src, PoolPages)
    return manifest, src, res


def _land(d: DecodeHalf, src: PoolPages, pages: list[int]) -> None:
    d.pool.k[:, pages] = src.k[:, list(src.page_ids[: len(pages)])]
    d.pool.v[:, pages] = src.v[:, list(src.page_ids[: len(pages)])]


def _baseline(d: DecodeHalf) -> bool:
    d.allocator.check_integrity()
    return d.allocator.num_free == d.pool.num_pages and not d.kv.landing and not d.kv.quarantined


def test_landed_kv_is_verified_in_place_and_admitted() -> None:
    p, d = _engines()
    m, src, res = _offer(p, d, "ok")
    pages = d.kv.claim(m)
    assert pages == res.page_ids and d.seqs["ok"].life.state is State.TRANSFERRING
    _land(d, src, pages)
    d.kv.accept_landed(m)
    assert d.seqs["ok"].life.state in (State.VERIFIED, State.DECODING)
    while d.has_work():
        d.step()
    assert _baseline(d)


@pytest.mark.parametrize("tamper", ["nonce", "reservation_id"])
def test_a_claim_that_does_not_name_the_reservation_moves_nothing_and_harms_nothing(tamper: str) -> None:
    """Not from the prefill worker the router chose: refused before a byte may land, and the live request keeps its
    reservation; the genuine arrival is then served."""
    p, d = _engines()
    m, src, res = _offer(p, d, "t")
    bad = msgspec.structs.replace(m, **{"nonce": {"nonce": "0" * 32},
                                        "reservation_id": {"reservation_id": "x"}}[tamper])
    with pytest.raises(TransferVerificationFailed, match=tamper) as e:
        d.kv.claim(bad)
    assert res.nonce not in e.value.message and res.reservation_id not in e.value.message  # nothing to learn
    assert d.seqs["t"].life.state is State.RESERVED and not d.kv.landing and d.kv.reservations["t"] == res
    pages = d.kv.claim(m)  # the real one
    _land(d, src, pages)
    d.kv.accept_landed(m)
    assert d.seqs["t"].life.state in (State.VERIFIED, State.DECODING)


def test_a_claim_that_names_the_reservation_but_does_not_match_it_fails_the_request() -> None:
    p, d = _engines()
    m, _, _ = _offer(p, d, "t")
    with pytest.raises(TransferVerificationFailed, match="num_tokens"):
        d.kv.claim(msgspec.structs.replace(m, num_tokens=m.num_tokens - 1))
    assert "t" not in d.seqs and _baseline(d)  # the request failed, its pages are free (and zero)
    assert not d.pool.k.any() and not d.pool.v.any()
    with pytest.raises(TransferVerificationFailed, match="holds no reservation"):
        d.kv.claim(m)  # the real one comes too late: nothing is reserved any more


def test_a_page_that_landed_wrong_fails_the_request_and_is_scrubbed() -> None:
    p, d = _engines()
    m, src, _ = _offer(p, d, "bad")
    pages = d.kv.claim(m)
    _land(d, src, pages)
    d.pool.k[0, pages[1], 0, 0, 0] += 1.0
    with pytest.raises(TransferVerificationFailed, match=r"page_checksums\[1\]"):
        d.kv.accept_landed(m)
    assert "bad" not in d.seqs and _baseline(d)
    assert not d.pool.k.any() and not d.pool.v.any()


@pytest.mark.parametrize("end", ["release", "abort", "expire", "fail_all"])
def test_pages_stay_pinned_while_bytes_may_land_even_when_the_request_ends(end: str) -> None:
    p, d = _engines()
    m, src, _ = _offer(p, d, "late")
    pages = d.kv.claim(m)
    free = d.allocator.num_free
    match end:
        case "release":
            d.kv.release("late", WorkerFailed("the router gave up"), rejected=False)
        case "abort":
            d.abort("late", RequestAborted("client left"))
        case "expire":
            d.seqs["late"].reserved_until = 0.0
            d.kv.expire_reservations(1.0)
        case "fail_all":
            d.fail_all(WorkerFailed("internal fault"))
    out = d.step() if end != "fail_all" else []
    assert "late" not in d.seqs  # the request ended at once, with its error ...
    assert all(x.final is None or x.error is not None for x in out)
    assert d.allocator.num_free == free and set(pages) <= set(d.allocator.owned_by(d.kv.quarantined["late"].owner))
    _land(d, src, pages)  # ... and a byte that lands now hits only its own pages
    with pytest.raises(TransferVerificationFailed, match="ended while its KV was landing"):
        d.kv.accept_landed(m)
    assert _baseline(d) and not d.pool.k.any() and not d.pool.v.any()  # freed only now, scrubbed


def test_a_landing_that_failed_frees_and_scrubs_the_pages() -> None:
    p, d = _engines()
    m, src, _ = _offer(p, d, "cut")
    pages = d.kv.claim(m)
    _land(d, src, pages[:1])  # half of it arrived before the link was cut
    d.kv.landing_failed("cut", TransferTimeout("the read was cancelled"))
    assert "cut" not in d.seqs and _baseline(d) and not d.pool.k.any()
    d.kv.landing_failed("cut", TransferTimeout("again"))  # a second report changes nothing
    assert _baseline(d)

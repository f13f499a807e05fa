"""Decode reservations: renewed ones outlive their first deadline, others expire, an ended one stays ended."""

from __future__ import annotations

import time

from kvseal.config import CacheConfig, EngineConfig, ModelConfig
from kvseal.wire.messages import GenerateRequest, SamplingParams
from tests.helpers.halves import decode_engine

from .conftest import tiny_checkpoint


def _req(rid: str) -> GenerateRequest:
    return GenerateRequest(rid, list(range(2, 30)), SamplingParams(max_tokens=4, temperature=0.0))


def test_renewed_reservation_survives_and_unrenewed_expires() -> None:
    d = decode_engine(EngineConfig(model=ModelConfig(max_model_len=128),
                                  cache=CacheConfig(page_size=4, pool_tokens=256)), tiny_checkpoint())
    d.kv.reserve(_req("kept"), timeout_s=0.05, kv_endpoint="tcp://test")
    d.kv.reserve(_req("lapsed"), timeout_s=0.05, kv_endpoint="tcp://test")
    d.kv.renew("kept", time.monotonic() + 60)
    time.sleep(0.1)
    d.kv.expire_reservations(time.monotonic())
    assert set(d.kv.reserved) == {"kept"}
    out = {x.request_id: x for x in d.step()}
    assert out["lapsed"].final == "failed" and out["lapsed"].error is not None
    assert out["lapsed"].error.code == "transfer_timeout"
    d.kv.renew("lapsed", time.monotonic() + 60)  # too late: an ended reservation is not brought back
    assert "lapsed" not in d.kv.reserved
    held = d.pool.num_pages - d.allocator.num_free
    assert held == len(d.kv.reserved["kept"].pages) > 0  # only the renewed one still holds pages

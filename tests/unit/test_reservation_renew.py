"""Decode reservations: renewed ones outlive their first deadline, others expire, an ended one stays ended."""

from __future__ import annotations

import time

from kvseal.config import CacheConfig, EngineConfig, ModelConfig
from kvseal.engine.disagg import DecodeEngine
from kvseal.engine.messages import GenerateRequest, SamplingParams

from .conftest import tiny_checkpoint


def _req(rid: str) -> GenerateRequest:
    return GenerateRequest(rid, list(range(2, 30)), SamplingParams(max_tokens=4, temperature=0.0))


def test_renewed_reservation_survives_and_unrenewed_expires() -> None:
    d = DecodeEngine(EngineConfig(model=ModelConfig(max_model_len=128),
                                  cache=CacheConfig(page_size=4, pool_tokens=256)), tiny_checkpoint())
    d.reserve(_req("kept"), timeout_s=0.05, kv_endpoint="tcp://test")
    d.reserve(_req("lapsed"), timeout_s=0.05, kv_endpoint="tcp://test")
    d.renew("kept", time.monotonic() + 60)
    time.sleep(0.1)
    d.expire_reservations(time.monotonic())
    assert set(d.reserved) == {"kept"}
    out = {x.request_id: x for x in d.step()}
    assert out["lapsed"].final == "failed" and out["lapsed"].error is not None
    assert out["lapsed"].error.code == "transfer_timeout"
    d.renew("lapsed", time.monotonic() + 60)  # too late: an ended reservation is not brought back
    assert "lapsed" not in d.reserved
    held = d.pool.num_pages - d.allocator.num_free
    assert held == len(d.reserved["kept"][0].pages) > 0  # only the renewed one still holds pages

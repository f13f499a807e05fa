"""Per-tenant limits at the router (tenancy/limits.py, tenancy/ratelimit.py): token buckets on a fake clock, and over
HTTP the 429 in OpenAI's shape with Retry-After and the x-ratelimit-* headers, before the backend sees anything;
the other tenant is neither refused nor charged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvseal.api.app import build_app
from kvseal.config import ServerConfig, TenantPolicy
from kvseal.errors import RateLimited
from kvseal.tenancy.limits import RateLimiter, duration
from kvseal.tenancy.tenant_file import key_digest
from kvseal.wire.messages import GenerateDelta, GenerateRequest

from .conftest import FakeTokenizer


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_requests_bucket_holds_a_minute_and_refills_at_rpm_over_60() -> None:
    clock = Clock()
    lim = RateLimiter({"a": TenantPolicy(rpm=6)}, clock)
    for _ in range(6):
        lim.release(lim.admit("a"))
    with pytest.raises(RateLimited) as e:
        lim.admit("a")
    assert e.value.type == "requests" and e.value.status == 429 and e.value.code == "rate_limit_exceeded"
    assert e.value.retry_after_s == pytest.approx(10.0)  # one request back every 60/6 s
    clock.t += 10.0
    lim.release(lim.admit("a"))
    assert lim.figures()["a"]["rate_limited_requests"] == 1
    for _ in range(100):  # a tenant without limits is never refused
        lim.admit("b")


def test_concurrency_counts_requests_in_flight_until_released() -> None:
    lim = RateLimiter({"a": TenantPolicy(max_concurrent=2)}, Clock())
    first, _second = lim.admit("a"), lim.admit("a")
    with pytest.raises(RateLimited, match="concurrent"):
        lim.admit("a")
    lim.release(first)
    lim.release(first)  # a lease is released once
    lim.admit("a")
    with pytest.raises(RateLimited):
        lim.admit("a")


def test_tokens_are_charged_at_admission_and_unused_output_refunded() -> None:
    clock = Clock()
    lim = RateLimiter({"a": TenantPolicy(tpm=600)}, clock)
    lease = lim.admit("a")
    lim.charge(lease, 100, 400)
    assert dict(lim.headers("a"))["x-ratelimit-remaining-tokens"] == "100"
    with pytest.raises(RateLimited) as e:
        lim.charge(lim.admit("a"), 100, 100)
    assert e.value.type == "tokens" and e.value.retry_after_s == pytest.approx(10.0)  # 100 missing at 10/s
    lease.used += 50  # it produced 50 of its 400 (the route counts output tokens as they stream)
    lim.release(lease)
    assert dict(lim.headers("a"))["x-ratelimit-remaining-tokens"] == "450"
    with pytest.raises(RateLimited) as e:  # larger than the limit itself: never admitted, never retried
        lim.charge(lim.admit("a"), 500, 101)
    assert e.value.retry_after_s is None and "too large" in e.value.message


def test_reset_durations_read_as_openais() -> None:
    assert [duration(x) for x in (0.0201, 1.5, 60.0, 360.0)] == ["21ms", "1.5s", "1m0s", "6m0s"]


class SlowBackend:
    """Answers each request with `out` tokens, each after the test lets it go (requests stay in flight)."""

    model_name, context_window = "m", 256

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.seen: list[str] = []
        self.gate: asyncio.Event | None = None

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        self.seen.append(req.tenant)
        yield GenerateDelta(req.request_id, [3, 4], "bc", final="length", prompt_tokens=len(req.prompt_ids),
                            completion_tokens=2)

    async def info(self) -> dict[str, Any]:
        return {"role": "test"}

    async def healthy(self) -> bool:
        return True


def _app(backend: SlowBackend, **policies: TenantPolicy) -> TestClient:
    keys = tuple((key_digest(f"sk-{t}"), t) for t in ("alice", "bob"))
    return TestClient(build_app(backend, ServerConfig(api_keys=keys, tenants=tuple(policies.items()))))


def test_over_rpm_is_a_429_in_openais_shape_and_the_other_tenant_passes() -> None:
    backend = SlowBackend()
    body = {"model": "m", "prompt": "abc", "max_tokens": 2}
    with _app(backend, alice=TenantPolicy(rpm=2, tpm=1000)) as c:
        alice, bob = {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-bob"}
        oks = [c.post("/v1/completions", headers=alice, json=body) for _ in range(2)]
        assert [r.status_code for r in oks] == [200, 200]
        h = oks[1].headers
        assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("2", "0")
        assert h["x-ratelimit-reset-requests"].endswith("s")
        assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"]) == ("1000", str(1000 - 2 * 5))
        r = c.post("/v1/completions", headers=alice, json=body)
        assert r.status_code == 429
        assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "requests", "param": None,
                                      "code": "rate_limit_exceeded"}}
        assert "RPM" in r.json()["error"]["message"]
        assert 0 < float(r.headers["retry-after-ms"]) <= 30_000 and int(r.headers["retry-after"]) >= 1
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert backend.seen == ["alice", "alice"]  # the refused request reached no backend
        for _ in range(5):  # bob has no limits: never refused, no rate headers
            rb = c.post("/v1/completions", headers=bob, json=body)
            assert rb.status_code == 200 and "x-ratelimit-limit-requests" not in rb.headers
        metrics = c.app.state.limits.figures()  # type: ignore[attr-defined]
        assert metrics["alice"]["rate_limited_requests"] == 1 and metrics["alice"]["in_flight"] == 0


def test_over_tpm_is_a_429_of_type_tokens_before_the_backend() -> None:
    backend = SlowBackend()
    with _app(backend, alice=TenantPolicy(tpm=60)) as c:
        alice = {"Authorization": "Bearer sk-alice"}
        r = c.post("/v1/completions", headers=alice, json={"model": "m", "prompt": "abc", "max_tokens": 50})
        assert r.status_code == 200  # 53 charged when it was admitted (7 left then: the headers say so) ...
        assert r.headers["x-ratelimit-remaining-tokens"] == "7"
        # ... and the 48 it did not produce given back at its end: 55 left, a refill of 1/s could not reach that
        r = c.post("/v1/completions", headers=alice, json={"model": "m", "prompt": "abc", "max_tokens": 50})
        assert r.status_code == 200
        r = c.post("/v1/completions", headers=alice, json={"model": "m", "prompt": "abc", "max_tokens": 55})
        assert r.status_code == 429 and r.json()["error"]["type"] == "tokens"
        assert "retry-after" in r.headers
        r = c.post("/v1/completions", headers=alice, json={"model": "m", "prompt": "abc", "max_tokens": 100})
        assert r.status_code == 429 and r.headers["x-should-retry"] == "false" and "retry-after" not in r.headers
        assert backend.seen == ["alice", "alice"]


def test_weight_and_class_come_from_the_file_never_from_the_body() -> None:
    seen: list[GenerateRequest] = []

    class Recording(SlowBackend):
        async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
            seen.append(req)
            async for d in super().generate(req):
                yield d

    with _app(Recording(), alice=TenantPolicy(weight=3, priority_class=2, kv_share=0.5)) as c:
        alice = {"Authorization": "Bearer sk-alice"}
        body = {"model": "m", "prompt": "abc", "max_tokens": 2, "priority": -5}
        assert c.post("/v1/completions", headers=alice, json=body).status_code == 200
        for forged in ({"weight": 100}, {"priority_class": -9}):
            r = c.post("/v1/completions", headers=alice, json={**body, **forged})
            assert r.status_code == 400 and r.json()["error"]["param"] in forged
        assert c.post("/v1/completions", headers={"Authorization": "Bearer sk-bob"}, json=body).status_code == 200
    a, b = seen
    assert (a.weight, a.priority_class, a.kv_share, a.priority) == (3.0, 2, 0.5, -5)
    assert (b.weight, b.priority_class, b.kv_share, b.priority) == (1.0, 0, 1.0, -5)

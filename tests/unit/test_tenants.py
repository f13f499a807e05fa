"""Tenants from --api-keys: the file's format and errors (which never echo a key), the 401s, the tenant handed
to the backend with each request, and cache-aware prefill routing that follows prefixes only within a tenant."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvseal.api.app import build_app
from kvseal.config import ServerConfig
from kvseal.router.affinity import PrefixAffinity
from kvseal.tenancy.tenants import load_api_keys
from kvseal.wire.messages import GenerateDelta, GenerateRequest, SamplingParams

from .conftest import FakeTokenizer

KEYS = "# tenants of this server\nalice sk-alice-1\nalice sk-alice-2  # a second key\n\nbob sk-bob\n"


def test_key_file_maps_keys_to_tenants(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(KEYS)
    keys = load_api_keys(str(f))
    assert sorted(t for _, t in keys) == ["alice", "alice", "bob"]
    assert "sk-" not in repr(keys) and "sk-" not in repr(ServerConfig(api_keys=keys))  # digests only


@pytest.mark.parametrize("text", ["alice\n", "alice sk-1 extra\n", "al ice sk-1 sk-2\n", "a/b sk-secret-9\n",
                                  "alice sk-secret-9\nbob sk-secret-9\n", "# nothing\n"])
def test_bad_key_files_are_refused_without_echoing_keys(tmp_path: Path, text: str) -> None:
    f = tmp_path / "keys"
    f.write_text(text)
    with pytest.raises(ValueError) as e:
        load_api_keys(str(f))
    assert "--api-keys" in str(e.value) and "sk-" not in str(e.value)


class RecordingBackend:
    """Answers every request with one token and records the tenant and cache_salt it was given."""

    model_name, context_window = "m", 256

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.seen: list[tuple[str, str | None]] = []

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        self.seen.append((req.tenant, req.cache_salt))
        yield GenerateDelta(req.request_id, [3], "b", final="length", prompt_tokens=len(req.prompt_ids),
                            completion_tokens=1, cached_tokens=2)

    async def info(self) -> dict[str, Any]:
        return {"role": "test"}

    async def healthy(self) -> bool:
        return True


def test_every_route_but_health_needs_a_known_key(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(KEYS)
    backend = RecordingBackend()
    body = {"model": "m", "prompt": "abc", "max_tokens": 1}
    with TestClient(build_app(backend, ServerConfig(api_keys=load_api_keys(str(f))))) as c:
        assert c.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer sk-nobody"}, {"Authorization": "sk-alice-1"},
                        {"Authorization": "Basic sk-alice-1"}):
            for method, path in (("GET", "/info"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
                                 ("GET", "/no/such/route")):
                r = c.request(method, path, headers=headers, json=body)
                assert r.status_code == 401, (headers, path)
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
                assert "sk-" not in r.text
        for key, tenant in (("sk-alice-1", "alice"), ("sk-alice-2", "alice"), ("sk-bob", "bob")):
            r = c.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={**body, "cache_salt": "s"})
            assert r.status_code == 200 and backend.seen[-1] == (tenant, "s")
            assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
        assert c.get("/v1/models", headers={"Authorization": "bearer sk-bob"}).status_code == 200
        assert "sk-" not in c.get("/info", headers={"Authorization": "Bearer sk-bob"}).text


def test_without_keys_there_is_one_tenant() -> None:
    backend = RecordingBackend()
    with TestClient(build_app(backend, ServerConfig())) as c:
        for headers in ({}, {"Authorization": "Bearer anything"}):
            r = c.post("/v1/completions", headers=headers, json={"model": "m", "prompt": "abc", "max_tokens": 1})
            assert r.status_code == 200
    assert backend.seen == [("", None), ("", None)]


@dataclass
class FakeWorker:
    endpoint: str
    inflight: int = 0


def _req(ids: list[int], tenant: str = "t") -> GenerateRequest:
    return GenerateRequest("r", ids, SamplingParams(max_tokens=1), tenant=tenant)


def test_prefill_routing_follows_a_prefix_within_its_tenant() -> None:
    aff = PrefixAffinity(slack=2)
    workers = [FakeWorker("a"), FakeWorker("b"), FakeWorker("c")]
    shared = list(range(40))
    first = aff.pick(workers, _req(shared + [1]), 16)
    for i in range(10):  # the same two pages with other suffixes: always where they went first
        assert aff.pick(workers, _req(shared[:32] + [i] * 20), 16) is first
    assert aff.routed_by_prefix == 10
    aff.pick(workers, _req(shared + [1], tenant="other"), 16)
    assert aff.routed_by_prefix == 10  # another tenant's prompt is not steered by this tenant's history
    first.inflight = 3  # more than `slack` above the others: load wins
    assert aff.pick(workers, _req(shared + [2]), 16) is not first
    assert aff.pick([w for w in workers if w is not first], _req(shared + [3]), 16) is not first  # first died


def test_prefill_routing_without_a_match_takes_the_least_loaded() -> None:
    aff = PrefixAffinity()
    workers = [FakeWorker("a", 2), FakeWorker("b", 0), FakeWorker("c", 1)]
    assert all(aff.pick(workers, _req([i] * 48), 16).endpoint == "b" for i in range(5))


def test_serve_refuses_a_bad_key_file_before_starting_anything(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from kvseal.cli import main

    f = tmp_path / "keys"
    f.write_text("alice sk-secret-1 sk-secret-2\n")
    for argv in (["serve", "--api-keys", str(f)], ["router", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2",
                                                  "--api-keys", str(f)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "--api-keys" in err and "line 1" in err and "sk-secret" not in err

"""A worker's metrics port and the metrics token (metrics/token.py, metrics/engine.py), over real loopback HTTP on the
tiny model: without an Authorization header the port names no tenant and still serves the fleet-level families,
the token's bearer gets every tenant's figures, any other Authorization gets 401; the token file is refused when
it cannot be a token, and no message echoes it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvseal.cli import build_parser
from kvseal.cli.serve import worker_specs
from kvseal.engine.engine import Engine
from kvseal.metrics.engine import EngineCollector, WorkerMetrics
from kvseal.metrics.token import gated, token_sha256
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire.messages import GenerateRequest, SamplingParams
from kvseal.worker.run import WorkerSpec

from .conftest import make_engine

TOKEN = "mt-9f3c1a7e5b2d4c6e8a0b"
TENANTS = ("acme", "globex")
FLEET_LEVEL = ("kvseal:kv_cache_usage_perc", "kvseal:pages_scrubbed", "kvseal:request_queue_time_seconds",
               "kvseal:worker_info", "kvseal:num_requests_running")


def families(text: str) -> dict[str, list[dict[str, str]]]:
    return {f.name: [s.labels for s in f.samples] for f in text_string_to_metric_families(text)}


@pytest.fixture(scope="module")
def engine(tiny: Checkpoint) -> Engine:
    e = make_engine(tiny)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i, tenant in enumerate(TENANTS):
        e.add_request(GenerateRequest(f"r{i}", [2 + i] * 6, params, tenant=tenant))
    while e.scheduler.running or e.scheduler.waiting:
        e.step()
    assert set(e.info()["tenants"]) == set(TENANTS)  # type: ignore[arg-type]
    return e


@pytest.fixture(scope="module")
def url(engine: Engine) -> Iterator[str]:
    m = WorkerMetrics(EngineCollector(engine, labels={"endpoint": "tcp://x"}))
    yield m.serve("127.0.0.1", 0, hashlib.sha256(TOKEN.encode()).hexdigest())


def test_a_scrape_without_a_header_names_no_tenant_but_keeps_the_fleet_level_families(url: str) -> None:
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200
    assert not any(t in r.text for t in TENANTS), [ln for ln in r.text.splitlines() if "acme" in ln][:3]
    fams = families(r.text)
    assert not [n for n in fams if n.startswith("kvseal:tenant_")]
    assert not [n for n, samples in fams.items() if any("tenant" in s for s in samples)]
    assert set(FLEET_LEVEL) <= set(fams), set(FLEET_LEVEL) - set(fams)


def test_the_metrics_token_gets_every_tenants_figures(url: str) -> None:
    for header in (f"Bearer {TOKEN}", f"bearer  {TOKEN}"):  # the scheme is case-insensitive (RFC 7235)
        r = httpx.get(url, headers={"Authorization": header}, timeout=10)
        assert r.status_code == 200
        fams = families(r.text)
        assert {s["tenant"] for s in fams["kvseal:tenant_prefill_tokens"]} == set(TENANTS)
        assert set(FLEET_LEVEL) <= set(fams)
    # name[] filters within what the scrape may see, never beyond it
    only = httpx.get(url, params={"name[]": "kvseal:tenant_kv_pages"}, timeout=10)
    assert only.status_code == 200 and "acme" not in only.text


def test_a_wrong_token_gets_401_and_no_figures(url: str) -> None:
    for header in (f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", "Bearer", f"Basic {TOKEN}", "sk-acme-key"):
        r = httpx.get(url, headers={"Authorization": header}, timeout=10)
        assert r.status_code == 401, header
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert "kvseal:" not in r.text and "acme" not in r.text and TOKEN not in r.text


def test_without_a_token_file_nobody_gets_the_tenants(engine: Engine) -> None:
    url = WorkerMetrics(EngineCollector(engine)).serve("127.0.0.1", 0, None)
    assert httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).status_code == 401
    assert "acme" not in httpx.get(url, timeout=10).text


def test_the_gate_picks_one_app_per_scrape() -> None:
    def app(name: bytes):  # type: ignore[no-untyped-def]
        return lambda environ, start: [name]

    gate = gated(app(b"public"), app(b"full"), hashlib.sha256(TOKEN.encode()).hexdigest())
    seen: list[str] = []
    assert gate({}, seen.append) == [b"public"]
    assert gate({"HTTP_AUTHORIZATION": f"Bearer {TOKEN}"}, seen.append) == [b"full"]
    assert b"401" in gate({"HTTP_AUTHORIZATION": "Bearer nope"}, lambda *a: seen.append(a[0]))[0]
    assert seen == ["401 Unauthorized"]


def test_the_token_file_is_kept_as_a_digest_and_a_bad_one_stops_the_start(tmp_path: Path) -> None:
    good = tmp_path / "token"
    good.write_text(TOKEN + "\n")  # a trailing newline is dropped, as Prometheus drops it from credentials_file
    assert token_sha256(str(good)) == hashlib.sha256(TOKEN.encode()).hexdigest()
    assert token_sha256(None) is None
    for text, says in (("short-token", "11 characters"), ("a token with spaces in it", "spaces"),
                       ("", "0 characters")):
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(ValueError, match="--metrics-token-file") as e:
            token_sha256(str(bad))
        assert says in str(e.value) and (not text or text not in str(e.value))
    with pytest.raises(ValueError, match="cannot read"):
        token_sha256(str(tmp_path / "missing"))


def test_serve_hands_every_worker_the_digest_never_the_token(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text(TOKEN)
    prefill, decode = worker_specs(build_parser().parse_args(["serve", "--metrics-token-file", str(f)]), 2)
    assert prefill.metrics_token_sha256 == decode.metrics_token_sha256 == hashlib.sha256(TOKEN.encode()).hexdigest()
    assert TOKEN not in repr(decode)
    assert build_parser().parse_args(["decode", "--metrics-token-file", str(f)]).metrics_token_file == str(f)
    with pytest.raises(ValueError, match="metrics_token_sha256"):
        WorkerSpec(role="decode", engine=decode.engine, metrics_token_sha256=TOKEN)
    unified = build_parser().parse_args(["serve", "--unified", "--metrics-token-file", str(f)])
    with pytest.raises(ValueError, match="--unified"):  # it has no worker port: the flag is refused, not ignored
        unified.func(unified)

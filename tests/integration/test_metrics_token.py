"""Issue 30, item 4: a worker's metrics port names no tenant unless the scrape brings the metrics token.

`kvseal serve` with tenants acme and globex (and an admin key) and `--metrics-token-file`, real worker processes:
after each tenant's request, a scrape of either worker's metrics port without an Authorization header has no tenant
name and no per-tenant family but still the fleet-level families; the token's bearer gets each tenant's figures;
any other key (a tenant's API key, the admin API key, a token one character off) gets 401 and no figures. The
router's own /metrics stays admin-only.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.procs import Server

pytestmark = pytest.mark.integration
MODEL = "SmolLM2-135M-Instruct"
KEYS = {"acme": "sk-acme-mtoken-0001", "globex": "sk-globex-mtoken-0002", "ops": "sk-ops-mtoken-0003"}
TOKEN = "mt-0c5e2b9a7d41f3e86b20"
TENANTS = ("acme", "globex")
FLEET_LEVEL = ("kvseal:kv_cache_usage_perc", "kvseal:pages_scrubbed", "kvseal:kv_transfers",
               "kvseal:requests_received", "kvseal:request_queue_time_seconds", "kvseal:worker_info")
Families = dict[str, list[tuple[dict[str, str], float]]]


def families(text: str) -> Families:
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("mtoken")
    (d / "api-keys").write_text(f"acme {KEYS['acme']}\nglobex {KEYS['globex']}\nops {KEYS['ops']} admin\n")
    (d / "metrics-token").write_text(TOKEN + "\n")
    s = Server(["--api-keys", str(d / "api-keys"), "--metrics-token-file", str(d / "metrics-token"),
                "--max-model-len", "512", "--kv-pool-tokens", "1024"])
    try:
        s.ready(300)
        for tenant in TENANTS:
            r = httpx.post(s.url + "/v1/completions", headers={"Authorization": f"Bearer {KEYS[tenant]}"},
                           timeout=300, json={"model": MODEL, "prompt": f"{tenant} says hello", "max_tokens": 4,
                                              "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def ports(server: Server) -> dict[str, str]:
    """role -> its worker's metrics URL (the router's /info tells admin keys)."""
    info = httpx.get(server.url + "/info", headers={"Authorization": f"Bearer {KEYS['ops']}"}, timeout=10).json()
    urls = {w["role"]: w["metrics_endpoint"] for w in info["workers"]}
    assert set(urls) == {"prefill", "decode"} and all(u.startswith("http://127.0.0.1:") for u in urls.values())
    return urls


def test_a_scrape_without_a_key_names_no_tenant_and_keeps_the_fleet_level_families(ports: dict[str, str]) -> None:
    for role, url in ports.items():
        r = httpx.get(url, timeout=10)
        assert r.status_code == 200, role
        named = [ln for ln in r.text.splitlines() if any(t in ln for t in TENANTS)]
        assert not named, (role, named[:3])
        fams = families(r.text)
        assert not [n for n in fams if n.startswith("kvseal:tenant_")], role
        assert not [n for n, samples in fams.items() if any("tenant" in labels for labels, _ in samples)], role
        assert set(FLEET_LEVEL) <= set(fams), (role, set(FLEET_LEVEL) - set(fams))
        received = [v for labels, v in fams["kvseal:requests_received"] if not labels]
        assert received and received[0] >= len(TENANTS), role  # the figures are live, not an empty registry


def test_the_metrics_token_gets_each_tenants_figures(ports: dict[str, str]) -> None:
    got = {role: families(httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).text)
           for role, url in ports.items()}
    prefill = {labels["tenant"]: v for labels, v in got["prefill"]["kvseal:tenant_prefill_tokens"]}
    decode = {labels["tenant"]: v for labels, v in got["decode"]["kvseal:tenant_decode_tokens"]}
    assert set(prefill) >= set(TENANTS) and all(prefill[t] > 0 for t in TENANTS), prefill
    assert set(decode) >= set(TENANTS) and all(decode[t] > 0 for t in TENANTS), decode
    for fams in got.values():
        assert set(FLEET_LEVEL) <= set(fams)


def test_any_other_key_gets_401_and_no_figures(ports: dict[str, str]) -> None:
    wrong = [KEYS["globex"], KEYS["ops"], TOKEN[:-1] + ("0" if TOKEN[-1] != "0" else "1"), TOKEN + TOKEN]
    for url in ports.values():
        for key in wrong:
            r = httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=10)
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), key
            assert "kvseal:" not in r.text and not any(t in r.text for t in TENANTS)


def test_the_routers_metrics_stay_admin_only(server: Server) -> None:
    url = server.url + "/metrics"
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEYS['globex']}"}, timeout=10).status_code == 403
    assert httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).status_code == 401
    admin = httpx.get(url, headers={"Authorization": f"Bearer {KEYS['ops']}"}, timeout=10)
    assert admin.status_code == 200 and 'tenant="globex"' in admin.text


def test_each_worker_says_at_start_that_its_tenants_need_the_token(server: Server) -> None:
    assert server.output().count("(per-tenant figures: with the metrics token)") == 2
    assert TOKEN not in server.output()

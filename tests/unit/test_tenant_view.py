"""Tenants see only their own world: with --api-keys, /info shows a tenant key the model, the window and its own
requests, never the fleet (workers, endpoints, the fleet socket, other tenants' load); /metrics and /doctor/probe
are for admin keys (`TENANT KEY admin`). Without --api-keys every client sees everything (one tenant)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from kvseal.api.app import build_app
from kvseal.api.routes.probe import install_probe
from kvseal.config import ServerConfig
from kvseal.metrics.router import RouterMetrics
from kvseal.metrics.router import install as install_metrics
from kvseal.tenancy.tenants import read_key_file

from .test_tenants import RecordingBackend

KEYS = "alice sk-alice\nbob sk-bob\nops sk-ops admin  # sees the fleet\n"
FLEET = {"role": "router", "fleet_endpoint": "tcp://0.0.0.0:7000", "live_requests": 3,
         "workers": [{"role": "decode", "endpoint": "tcp://10.0.0.2:5000", "kv_endpoint": "tcp://10.0.0.2:5001",
                      "running": 7}]}


class FleetBackend(RecordingBackend):
    async def info(self) -> dict[str, Any]:
        return dict(FLEET)


def _client(tmp_path: Path, keys: str | None) -> TestClient:
    cfg = ServerConfig()
    if keys is not None:
        (tmp_path / "keys").write_text(keys)
        tenants, admins = read_key_file(str(tmp_path / "keys"))
        cfg = ServerConfig(api_keys=tenants, admin_keys=admins)
    backend = FleetBackend()
    app = build_app(backend, cfg)
    install_metrics(app, RouterMetrics(backend))
    install_probe(app, backend)
    return TestClient(app)


def test_a_tenants_info_shows_its_own_world_and_an_admin_sees_the_fleet(tmp_path: Path) -> None:
    body = {"model": "m", "prompt": "abc", "max_tokens": 1}
    with _client(tmp_path, KEYS) as c:
        for _ in range(2):
            assert c.post("/v1/completions", headers={"Authorization": "Bearer sk-alice"}, json=body).status_code == 200
        assert c.post("/v1/completions", headers={"Authorization": "Bearer sk-bob"}, json={**body, "max_tokens": -1}
                      ).status_code == 400
        alice = c.get("/info", headers={"Authorization": "Bearer sk-alice"}).json()
        assert alice == {"model": "m", "context_window": 256, "tenant": "alice",
                         "requests": {"in_flight": 0, "completed": 2, "failed": 0}}
        bob = c.get("/info", headers={"Authorization": "Bearer sk-bob"}).json()
        assert bob["requests"] == {"in_flight": 0, "completed": 0, "failed": 1}
        for shown in (alice, bob):  # nothing of the fleet, whatever it is called
            text = str(shown)
            assert "endpoint" not in text and "worker" not in text and "10.0.0.2" not in text and "7000" not in text
        assert c.get("/info", headers={"Authorization": "Bearer sk-ops"}).json() == FLEET


def test_metrics_and_probe_are_for_admin_keys(tmp_path: Path) -> None:
    with _client(tmp_path, KEYS) as c:
        for path, method in (("/metrics", "GET"), ("/doctor/probe", "POST")):
            r = c.request(method, path, headers={"Authorization": "Bearer sk-alice"})
            assert r.status_code == 403, (path, r.text)
            err = r.json()["error"]
            assert err["code"] == "permission_denied" and "admin" in err["message"], err
        r = c.get("/metrics", headers={"Authorization": "Bearer sk-ops"})
        assert r.status_code == 200 and "kvseal:request_errors_total" in r.text


def test_without_api_keys_every_client_sees_everything(tmp_path: Path) -> None:
    with _client(tmp_path, None) as c:
        assert c.get("/info").json() == FLEET
        assert c.get("/metrics").status_code == 200


def test_the_key_file_marks_admin_keys_and_keeps_its_two_word_lines(tmp_path: Path) -> None:
    (tmp_path / "k").write_text(KEYS)
    tenants, admins = read_key_file(str(tmp_path / "k"))
    assert sorted(t for _, t in tenants) == ["alice", "bob", "ops"]
    assert [dict(tenants)[d] for d in admins] == ["ops"]

"""Seal 3 at the router's door (api/routes/generate.py): a prompt plus max_tokens over the served window is a 400
`context_length_exceeded` naming both numbers, and the backend never sees the request (no worker does)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from kvseal.api.app import build_app
from kvseal.config import ServerConfig

from .test_fanout import ScriptedBackend


def test_a_request_over_the_window_never_reaches_the_backend() -> None:
    backend = ScriptedBackend({0: 1})  # serves a 256-token window; one token per prompt character
    with TestClient(build_app(backend, ServerConfig())) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "a" * 200, "max_tokens": 57})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        assert "maximum context length is 256 tokens" in err["message"] and "requested 257 tokens" in err["message"]
        assert backend.started == []  # no worker saw it
        ok = c.post("/v1/completions", json={"model": "m", "prompt": "a" * 200, "max_tokens": 56})
        assert ok.status_code == 200 and backend.started == [0]  # one token less fits

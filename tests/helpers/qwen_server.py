"""One Qwen2.5-Coder-0.5B server per mode (unified, disaggregated) for every agents' API test module (tools,
Anthropic Messages, OpenAI Responses, the clients people use): a server start costs the 2-core suite tens of
seconds, four modules times two modes would start eight. Each module is its own tenants (its own keys), so their
counters and prefix caches stay apart."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.procs import Server
from tests.helpers.real_models import real_model

KEYS = {"tools": "sk-tools-agents-0000", "m-alice": "sk-alice-messages-0001", "m-bob": "sk-bob-messages-0002",
        "r-alice": "sk-alice-responses-0001", "r-bob": "sk-bob-responses-0002", "clients": "sk-clients-0001",
        "e-alice": "sk-alice-embeddings-0001", "e-bob": "sk-bob-embeddings-0002", "e-limited": "sk-limited-emb-0003",
        "e-admin": "sk-admin-embeddings-0004"}
SETTINGS = {"e-limited": "rpm=2", "e-admin": "admin"}  # a key line's settings after the key (router/tenant_file.py)


@pytest.fixture(scope="session", params=["unified", "disaggregated"])
def qwen_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = tmp_path_factory.mktemp("qwen-keys") / "api-keys"
    keys.write_text("".join(f"{t} {k} {SETTINGS.get(t, '')}\n" for t, k in KEYS.items()))
    mode = ["--unified"] if request.param == "unified" else []
    # the embedding model beside it (tests/e2e/test_embeddings.py), on one thread (the suite runs two servers at
    # once), in small batches (its fair-queue test needs a flood of several batches, and a few seconds)
    s = Server([*mode, real_model("qwen2.5-coder-0.5b"), "--max-model-len", "2048", "--kv-pool-tokens", "16384",
                "--api-keys", str(keys), "--embed-model", real_model("all-minilm-l6-v2"), "--embed-threads", "1",
                "--embed-batch-tokens", "1024"])
    try:
        yield s.ready()
    finally:
        s.stop()

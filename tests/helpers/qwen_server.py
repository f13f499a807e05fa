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
        "r-alice": "sk-alice-responses-0001", "r-bob": "sk-bob-responses-0002", "clients": "sk-clients-0001"}


@pytest.fixture(scope="session", params=["unified", "disaggregated"])
def qwen_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = tmp_path_factory.mktemp("qwen-keys") / "api-keys"
    keys.write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
    mode = ["--unified"] if request.param == "unified" else []
    s = Server([*mode, real_model("qwen2.5-coder-0.5b"), "--max-model-len", "2048", "--kv-pool-tokens", "16384",
                "--api-keys", str(keys)])
    try:
        yield s.ready()
    finally:
        s.stop()

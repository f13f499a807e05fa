"""Issue 17, section 1, kept as a test: the rogue-worker attack against `kvseal serve --api-keys`, with real
processes on loopback.

An attacker holding only alice's API key read /info for the router's fleet endpoint and a decode worker's info,
sent a JoinReq naming its own socket, answered the router's InfoReq with the copied info, and got bob's requests
(his prompt ids: "Bob secret: the vault code is 7391"). Now alice's /info holds no fleet internals, and even an
attacker who knows the fleet port (given here with --fleet-port) and every worker's info (read here with the admin
key) is refused at the handshake: its JoinReq is never read, the router never sends it a frame, and bob's requests
all go to the real decode worker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvseal.auth.keys import fresh_member
from tests.helpers.procs import Server, free_port
from tests.helpers.rogue import RogueDecode

pytestmark = [pytest.mark.integration, pytest.mark.e2e]
MODEL = "SmolLM2-135M-Instruct"
KEYS = {"alice": "sk-alice-1", "bob": "sk-bob-1", "ops": "sk-ops-1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, int]]:
    f: Path = tmp_path_factory.mktemp("keys") / "api-keys"
    f.write_text("alice sk-alice-1\nbob sk-bob-1\nops sk-ops-1 admin\n")
    fleet_port = free_port()
    s = Server(["--api-keys", str(f), "--max-model-len", "512", "--fleet-port", str(fleet_port), "--ledger", "off"])
    try:
        yield s.ready(), fleet_port
    finally:
        s.stop()


def _get(s: Server, path: str, who: str) -> httpx.Response:
    return httpx.get(s.url + path, headers={"Authorization": f"Bearer {KEYS[who]}"}, timeout=30)


def test_a_tenant_cannot_join_the_fleet_and_read_another_tenants_prompts(server: tuple[Server, int]) -> None:
    s, fleet_port = server
    # 1. alice's view: nothing of the fleet (the attack started from /info's fleet_endpoint and workers)
    alice = _get(s, "/info", "alice").json()
    assert "fleet_endpoint" not in alice and "workers" not in alice, alice
    assert "127.0.0.1:" not in str(alice) and _get(s, "/metrics", "alice").status_code == 403
    # 2. the strongest attacker: the known port and the decode worker's full info (read with the admin key)
    full = _get(s, "/info", "ops").json()
    assert full["fleet_endpoint"].endswith(f":{fleet_port}") and full["fleet_auth"] == "curve"
    decode_info = next(w for w in full["workers"] if w["role"] == "decode")
    rogue = RogueDecode(decode_info)
    try:
        # no key: refused at the handshake, its JoinReq never read, so never answered
        assert rogue.join(f"127.0.0.1:{fleet_port}", timeout_s=4) is None
        # a CURVE key of its own and a guessed router key: no handshake either
        assert rogue.join(f"127.0.0.1:{fleet_port}", timeout_s=2, keys=fresh_member(),
                          server_key=fresh_member().public) is None
        # 3. bob's requests all go to the real fleet; not one frame reaches the rogue
        for i in range(6):
            r = httpx.post(s.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS['bob']}"},
                           json={"model": MODEL, "max_tokens": 2, "messages": [
                               {"role": "user", "content": f"Bob secret: the vault code is 7391 ({i})"}]}, timeout=120)
            assert r.status_code == 200, r.text
        assert rogue.frames == 0 and rogue.prompts == []
    finally:
        rogue.close()
    after = _get(s, "/info", "ops").json()
    assert rogue.endpoint not in [w["endpoint"] for w in after["workers"]] and len(after["workers"]) == 2
    # the router never read a message of the rogue's (not even to drop it)
    assert "join of" not in s.output() and "on the fleet socket" not in s.output()

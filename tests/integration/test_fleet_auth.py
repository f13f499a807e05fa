"""A fleet started with `kvseal keys` keys (`--fleet-keys DIR` on every role), with real processes on loopback:
a stranger connecting to a worker's control or KV port gets nothing read and nothing answered, and the worker
serves fine afterwards; a router holding a wrong key for a worker never talks to it; a member joins through the
fleet socket (the router then pins the key its join proved), a key off the allow-list is refused at the handshake,
and deleting a member's public key takes it out of rotation."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvseal.auth.curve import as_client
from kvseal.auth.keys import MemberKeys, fresh_member, load_member, public_key, write_key_set
from kvseal.auth.zap import USER
from kvseal.errors import WorkerFailed
from kvseal.model.locate import load_tokenizer
from kvseal.router.disagg import DisaggBackend
from kvseal.wire import protocol as P
from tests.helpers.fleet import LoopbackFleet, module_fleet
from tests.helpers.procs import Worker, free_port, wait_until
from tests.helpers.rogue import RogueDecode

pytestmark = [pytest.mark.integration, pytest.mark.e2e]
MODEL = "SmolLM2-135M-Instruct"
ARGS = ["--max-model-len", "256", "--kv-pool-tokens", "512"]


class Fleet(LoopbackFleet):
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvseal-keys-"))
        self.keys = str(self.dir / "fleet")
        write_key_set(self.keys, ["router", "prefill", "decode", "decode-2"])
        self.fleet_port = free_port()
        flag = ["--fleet-keys", self.keys]
        self.router_keys = load_member(self.keys, "router")
        super().__init__(ARGS, prefill=flag, decode=flag, router=[*flag, "--fleet-port", str(self.fleet_port)])
        for w in (self.prefill, self.decode):  # the test speaks to the workers as the router does
            w.client_keys, w.server_key = self.router_keys, public_key(self.keys, w.role)

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.dir, ignore_errors=True)


fleet = module_fleet(Fleet)


def _complete(fleet: Fleet) -> str | None:
    r = fleet.client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    return r.choices[0].finish_reason


def _stranger(endpoint: str, keys: MemberKeys | None, server_key: str | None,
              token: bytes | None = None) -> tuple[bool, bool]:
    """(answered, refused at the handshake) for an InfoReq from a stranger: no key, a key of its own, or (on a KV
    port with MAC framing) a guessed session token."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        as_client(sock, keys, server_key, "stranger")
        if token is not None:
            sock.setsockopt(zmq.PLAIN_USERNAME, USER)
            sock.setsockopt(zmq.PLAIN_PASSWORD, token)
        sock.connect(endpoint)
        sock.send(P.encode(P.InfoReq(call_id=1)))
        refused, deadline = False, time.monotonic() + (3 if keys is not None or token is not None else 0)
        while time.monotonic() < deadline and not refused:
            refused = (monitor.poll(100) > 0
                       and recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        return sock.poll(500) > 0, refused
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()


def test_strangers_get_nothing_from_the_control_and_kv_ports(fleet: Fleet) -> None:
    assert _complete(fleet) == "length"
    before = {w.role: w.info() for w in (fleet.prefill, fleet.decode)}
    assert before["decode"]["fleet_auth"] == "curve" and before["decode"]["kv_channel"] == "mac"
    for endpoint, member in ((f"tcp://{fleet.prefill.endpoint}", "prefill"),
                             (f"tcp://{fleet.decode.endpoint}", "decode")):
        assert _stranger(endpoint, None, None) == (False, False)  # no key: no handshake, nothing read
        # its own key, pinning the worker's real key: refused by the allow-list at the handshake
        assert _stranger(endpoint, fresh_member(), public_key(fleet.keys, member)) == (False, True)
    kv = before["decode"]["kv_endpoint"]  # MAC framing: a session token, which only the reservations carry
    assert _stranger(kv, None, None) == (False, False)
    assert _stranger(kv, fresh_member(), public_key(fleet.keys, "decode")) == (False, False)  # CURVE: no match
    assert _stranger(kv, None, None, token=b"0" * 64) == (False, True)
    after = {w.role: w.info() for w in (fleet.prefill, fleet.decode)}
    for role, refused in (("prefill", 1), ("decode", 2)):
        assert after[role]["auth_refused"] - before[role]["auth_refused"] == refused
        for counter in ("frames_refused", "requests_received"):  # not one frame was read
            assert after[role][counter] == before[role][counter], (role, counter)
    assert _complete(fleet) == "length"  # the fleet serves as before


def test_a_worker_alone_reads_nothing_a_stranger_sends_to_its_control_port(tmp_path: Path) -> None:
    """One worker with keys, no router (seconds, not a fleet: seal 9+4's mutation proof runs this)."""
    keys = str(tmp_path / "fleet")
    write_key_set(keys, ["router", "decode"])
    w = Worker("decode", [*ARGS, "--fleet-keys", keys])
    w.client_keys, w.server_key = load_member(keys, "router"), public_key(keys, "decode")
    try:
        w.ready()
        endpoint = f"tcp://{w.endpoint}"
        assert _stranger(endpoint, None, None) == (False, False)  # no key: no handshake, nothing read
        assert _stranger(endpoint, fresh_member(), public_key(keys, "decode")) == (False, True)  # off the list
        info = w.info()  # the router's member is answered
        assert info["fleet_auth"] == "curve" and info["auth_refused"] == 1
        assert info["frames_refused"] == 0 and info["requests_received"] == 0
    finally:
        w.stop()


def test_a_router_with_a_wrong_key_for_a_worker_never_talks_to_it(fleet: Fleet) -> None:
    before = fleet.prefill.info()
    tokenizer, _ = load_tokenizer(None)
    prefill_ep, decode_ep = f"tcp://{fleet.prefill.endpoint}", f"tcp://{fleet.decode.endpoint}"
    # prefill's endpoint given with decode's key (an operator's slip, or a rogue at a known endpoint)
    backend = DisaggBackend(tokenizer, None, [prefill_ep], [decode_ep], startup_timeout_s=4.0,
                            keys=fleet.router_keys, server_keys={prefill_ep: public_key(fleet.keys, "decode"),
                                                                 decode_ep: public_key(fleet.keys, "decode")})

    async def start() -> None:
        try:
            await backend.start()
        finally:
            await backend.stop()

    with pytest.raises(WorkerFailed, match="did not come up"):
        asyncio.run(start())
    after = fleet.prefill.info()
    for counter in ("frames_refused", "requests_received", "auth_refused"):
        assert after[counter] == before[counter], counter  # no frame, not even a handshake it could check


def test_a_member_joins_and_a_key_off_the_allow_list_is_refused_at_the_handshake(fleet: Fleet) -> None:
    router = f"router@127.0.0.1:{fleet.fleet_port}"
    joined = Worker("decode", [*ARGS, "--fleet-keys", fleet.keys, "--fleet-member", "decode-2", "--router", router])
    fleet.extra.append(joined.ready())
    wait_until(lambda: "admitted this worker" in joined.output(), 60, "the router admitted decode-2")
    # a stranger with a key of its own that pins the router's real key: refused at the handshake, never read
    rogue = RogueDecode({})
    try:
        assert rogue.join(f"127.0.0.1:{fleet.fleet_port}", 3, fresh_member(), public_key(fleet.keys, "router")) is None
    finally:
        rogue.close()
    assert rogue.frames == 0
    info = httpx.get(fleet.router.url + "/info", timeout=30).json()
    entries = {w["endpoint"]: w["state"] for w in info["workers"]}
    assert entries.get(f"tcp://127.0.0.1:{joined.port}") == "serving", entries
    assert rogue.endpoint not in entries and info["auth_refused"] >= 1
    # revoking decode-2 (deleting its public key file) takes it out of rotation within a heartbeat
    (Path(fleet.keys) / "public" / "decode-2.key").unlink()
    wait_until(lambda: {w["endpoint"]: w for w in httpx.get(fleet.router.url + "/info", timeout=30).json()[
        "workers"]}[f"tcp://127.0.0.1:{joined.port}"]["state"] == "refused", 15, "decode-2 refused once revoked")
    entry = next(w for w in httpx.get(fleet.router.url + "/info", timeout=30).json()["workers"]
                 if w["endpoint"] == f"tcp://127.0.0.1:{joined.port}")
    assert "revoked" in entry["reason"], entry
    assert _complete(fleet) == "length"  # the rest of the fleet serves on

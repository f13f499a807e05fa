"""Fleet keys on the command line: `kvseal keys` writes 0600 files, a member's keys load and never print their
secret, peers are named NAME@HOST:PORT, and a control, fleet or KV port off loopback without keys refuses to
start (exit 2) with a message that names the fix."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import msgspec
import pytest

from kvseal.auth.curve import check_bind, is_loopback
from kvseal.auth.keys import MemberKeys, fresh_member, load_member, public_key
from kvseal.cli import build_parser, main
from kvseal.config import EngineConfig
from kvseal.worker.run import WorkerSpec


def test_kvseal_keys_writes_0600_files_and_refuses_to_overwrite(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "fleet"
    assert main(["keys", str(d)]) == 0
    files = sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())
    assert files == ["private/decode.key_secret", "private/prefill.key_secret", "private/router.key_secret",
                     "public/decode.key", "public/prefill.key", "public/router.key"]
    for p in d.rglob("*"):
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p
    assert "secret-key" not in (d / "public" / "router.key").read_text()
    assert main(["keys", str(d), "prefill-2"]) == 0  # a member added later
    assert main(["keys", str(d), "router"]) == 2  # never overwritten
    assert "router.key exists" in capsys.readouterr().err


def test_a_members_keys_load_and_never_print_their_secret(tmp_path: Path) -> None:
    main(["keys", str(tmp_path)])
    keys = load_member(str(tmp_path), "prefill")
    assert keys.public == public_key(str(tmp_path), "prefill")
    assert keys.admits(public_key(str(tmp_path), "router")) and not keys.admits(fresh_member().public)
    assert keys.secret not in repr(keys) and keys.secret not in str(keys)
    spec = WorkerSpec(role="prefill", engine=EngineConfig(), keys=keys)
    assert keys.secret not in repr(spec)
    # the spec crosses to a worker as JSON on stdin: the keys arrive whole and validated
    assert msgspec.json.decode(msgspec.json.encode(spec), type=WorkerSpec).keys == keys
    os.chmod(tmp_path / "private" / "prefill.key_secret", 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_member(str(tmp_path), "prefill")
    with pytest.raises(ValueError, match="kvseal keys"):
        load_member(str(tmp_path), "nobody")
    with pytest.raises(ValueError, match="not the secret key's"):
        MemberKeys(public=fresh_member().public, secret=keys.secret)


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("127.3.2.1", True), ("localhost", True),
                                                ("::1", True), ("[::1]", True), ("0.0.0.0", False), ("*", False),
                                                ("10.0.0.5", False), ("myhost", False), ("::", False)])
def test_loopback_is_recognised(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_port_off_loopback_needs_keys(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError) as e:
        check_bind("0.0.0.0", None, "decode worker's KV port", "--kv-host")
    assert "--kv-host='0.0.0.0'" in str(e.value) and "kvseal keys DIR" in str(e.value)
    assert "--fleet-keys DIR" in str(e.value) and "127.0.0.1" in str(e.value)
    check_bind("0.0.0.0", fresh_member(), "decode worker's KV port", "--kv-host")  # with keys: fine
    check_bind("127.0.0.1", None, "decode worker's KV port", "--kv-host")  # loopback: allowed, with a warning
    assert "has no fleet keys" in caplog.text


@pytest.mark.parametrize("argv", [
    ["prefill", "--host", "0.0.0.0"],
    ["decode", "--kv-host", "0.0.0.0"],
    ["router", "--host", "0.0.0.0", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"],
    ["router", "--fleet-host", "10.1.2.3", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"],
    ["serve", "--fleet-keys", "off", "--host", "0.0.0.0"],
])
def test_every_role_refuses_a_fleet_port_off_loopback_without_keys(argv: list[str],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "without fleet keys" in err and "kvseal keys DIR" in err, err


def test_peers_are_named_by_member(tmp_path: Path) -> None:
    from kvseal.auth.options import peer

    main(["keys", str(tmp_path)])
    a = build_parser().parse_args(["router", "--fleet-keys", str(tmp_path), "--prefill", "x:1", "--decode", "y:2"])
    keys = load_member(str(tmp_path), "router")
    assert peer(a, "127.0.0.1:5", keys, "prefill") == ("tcp://127.0.0.1:5", public_key(str(tmp_path), "prefill"))
    assert peer(a, "decode@h:6", keys, "prefill") == ("tcp://h:6", public_key(str(tmp_path), "decode"))
    assert peer(a, "decode@h:6", None, "prefill") == ("tcp://h:6", None)  # no keys: the name is not needed
    with pytest.raises(ValueError, match="no public key"):
        peer(a, "ghost@h:7", keys, "prefill")

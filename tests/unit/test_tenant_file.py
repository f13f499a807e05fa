"""The tenants file (--api-keys): the old `TENANT KEY [admin]` lines keep working, settings per tenant are read
into a frozen TenantPolicy, and an unknown setting or a bad value refuses the start naming the line, never a key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvseal.config import ServerConfig, TenantPolicy
from kvseal.tenancy.tenant_file import read_tenants_file


def _read(tmp_path: Path, text: str) -> object:
    f = tmp_path / "keys"
    f.write_text(text)
    return read_tenants_file(str(f))


def test_old_lines_read_as_before_with_no_settings(tmp_path: Path) -> None:
    f = _read(tmp_path, "alice sk-a1\nalice sk-a2 # again\nops sk-ops admin\n")
    assert sorted(t for _, t in f.keys) == ["alice", "alice", "ops"]  # type: ignore[attr-defined]
    assert len(f.admins) == 1 and f.tenants == ()  # type: ignore[attr-defined]


def test_settings_become_each_tenants_policy(tmp_path: Path) -> None:
    f = _read(tmp_path, "alice sk-a1 weight=3 rpm=600\n"
                        "alice sk-a2 tpm=20000 max_concurrent=4  # settings on any of the tenant's lines\n"
                        "bob sk-b admin priority_class=1 kv_share=0.25\n"
                        "carol sk-c==\n")  # a key may hold `=`: the second word is always the key
    pol = dict(f.tenants)  # type: ignore[attr-defined]
    assert pol == {"alice": TenantPolicy(weight=3.0, rpm=600, tpm=20000, max_concurrent=4),
                   "bob": TenantPolicy(priority_class=1, kv_share=0.25)}
    assert len(f.admins) == 1  # type: ignore[attr-defined]
    cfg = ServerConfig(api_keys=f.keys, admin_keys=f.admins, tenants=f.tenants)  # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tenants[0][1].weight = 5  # type: ignore[misc]


@pytest.mark.parametrize(("text", "names"), [
    ("alice sk-secret-1 speed=9\n", ["line 1", "unknown setting 'speed'", "weight"]),
    ("alice sk-secret-1\nbob sk-secret-2 rpm=fast\n", ["line 2", "rpm", "integer"]),
    ("alice sk-secret-1 weight=0\n", ["line 1", "weight=0.0", "positive"]),
    ("alice sk-secret-1 weight=nan\n", ["line 1", "weight"]),
    ("alice sk-secret-1 kv_share=1.5\n", ["line 1", "kv_share"]),
    ("alice sk-secret-1 tpm=-5\n", ["line 1", "tpm"]),
    ("alice sk-secret-1 rpm=5\nalice sk-secret-2 rpm=6\n", ["line 2", "rpm", "line 1"]),
    ("alice sk-secret-1 sk-secret-2\n", ["line 1", "SETTING=VALUE"]),
    ("alice sk-secret-1 rpm=sk-secret-3\n", ["line 1", "rpm"]),
])
def test_bad_settings_refuse_naming_the_line_never_a_key(tmp_path: Path, text: str, names: list[str]) -> None:
    with pytest.raises(ValueError) as e:
        _read(tmp_path, text)
    msg = str(e.value)
    assert "--api-keys" in msg and "sk-secret" not in msg
    for name in names:
        assert name in msg, (name, msg)


def test_settings_for_a_tenant_without_a_key_are_refused_by_the_config() -> None:
    with pytest.raises(ValueError, match="tenants"):
        ServerConfig(api_keys=(("0" * 64, "alice"),), tenants=(("bob", TenantPolicy()),))


def test_serve_refuses_an_unknown_setting_before_starting_anything(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from kvseal.cli import main

    f = tmp_path / "keys"
    f.write_text("alice sk-secret-1\n\nbob sk-secret-2 burst=10\n")
    assert main(["serve", "--api-keys", str(f)]) == 2
    err = capsys.readouterr().err
    assert "line 3" in err and "burst" in err and "sk-secret" not in err

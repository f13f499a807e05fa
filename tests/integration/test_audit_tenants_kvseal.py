"""`kvseal audit --tenant-keys` against a real `kvseal serve --unified --api-keys` (two tenants and an admin, the
bundled SmolLM2, loopback): every probe holds and the audit exits 0; the same audit with both keys naming one
tenant finds the shared prefix cache and stored responses broken (so a clean result is not the probe's blindness).
Small on purpose: three prefix trials, eight samples of B alone and under a flood of two requests in flight."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvseal.audit.__main__ import main as audit_main
from tests.helpers.procs import Server

pytestmark = [pytest.mark.integration, pytest.mark.serial]  # serial: timing probes (scripts/test.sh)
KEYS = {"alice": "sk-audit-alice-01", "bob": "sk-audit-bob-02", "alice-too": "sk-audit-alice-03"}
ARGS = ["--probe-trials", "3", "--probe-chars", "1500", "--noisy-samples", "8", "--flood-concurrency", "2",
        "--flood-chars", "20000", "--timeout", "120", "--seed", "7"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"alice {KEYS['alice']}\nbob {KEYS['bob']}\nalice {KEYS['alice-too']}\n"
                    "ops sk-audit-ops-04 admin\n")
    # B waits for the step that runs when it arrives: on one thread (OMP_NUM_THREADS=1 in tests) a contended step of
    # 128 prompt tokens takes SmolLM2 1.1-1.7 s on a 2-core runner, past the noisy-neighbour probe's 1 s grace;
    # steps of 32 keep that wait short (docs/audit-tenants.md has the default's figures)
    s = Server(["--unified", "--max-model-len", "1024", "--kv-pool-tokens", "8192", "--contended-chunk-tokens", "32",
                "--api-keys", str(keys)])
    try:
        yield s.ready()
    finally:
        s.stop()


def audit(server: Server, a: str, b: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
          *extra: str) -> tuple[int, dict[str, str], dict[str, dict[str, object]]]:
    out = tmp_path / "tenants.json"
    code = audit_main([server.url, "--tenant-keys", f"{KEYS[a]},{KEYS[b]}", *ARGS, *extra, "--report", str(out)])
    printed = capsys.readouterr()
    assert not any(k in out.read_text() + printed.out + printed.err for k in KEYS.values())
    report = json.loads(out.read_text())
    return (code, {p["probe"]: p["verdict"] for p in report["probes"]},
            {p["probe"]: p["evidence"] for p in report["probes"]})


def test_two_tenants_are_kept_apart_by_every_probe(server: Server, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, verdicts, evidence = audit(server, "alice", "bob", tmp_path, capsys)
    assert verdicts == {"prefix_cache": "held", "stored_responses": "held", "status_pages": "held",
                        "noisy_neighbour": "held"}, json.dumps(evidence, indent=1)[:4000]
    assert code == 0
    assert evidence["status_pages"]["a_tenant_name"] == "alice" and evidence["status_pages"]["b_tenant_name"] == "bob"
    assert evidence["status_pages"]["statuses"]["/metrics"] == {"before": 403, "during": 403, "after": 403}  # type: ignore[index]


def test_two_keys_of_one_tenant_share_what_a_tenant_owns(server: Server, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, verdicts, _ = audit(server, "alice", "alice-too", tmp_path, capsys, "--probes",
                              "prefix_cache,stored_responses")
    assert (code, verdicts) == (1, {"prefix_cache": "broken", "stored_responses": "broken"})

"""`kvseal audit` catches the 2026 incident: against kvseal with the test-only incident fault (placeholder on
reject, no verification, no scrub, capacity only warned about) it fails; against the normal server it passes.
Both on the real model, disaggregated, with a prefill pool smaller than the served window. The normal server
passes with --strict: greedy answers under load equal the answers alone (batch invariance)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.procs import Server

pytestmark = pytest.mark.e2e
WINDOW = "1024"
# a small decode pool (pages recycle often); a long wait for pages instead of 503s, so most canaries are answered
FLEET = ["--max-model-len", WINDOW, "--kv-pool-tokens", WINDOW, "--wait-timeout", "600"]


def _audit(url: str, report: Path, strict: bool = False) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, "-m", "kvseal", "audit", url, *(["--strict"] if strict else []),
                        "--requests", "40", "--concurrency", "4",
                        "--over-window", "4", "--consistency-prompts", "4", "--max-tokens", "12", "--seed", "7",
                        "--report", str(report), "--timeout", "300"],
                       capture_output=True, text=True, timeout=1200, check=False)
    assert report.exists(), r.stdout + r.stderr
    return r.returncode, json.loads(report.read_text())


def test_audit_fails_the_incident_and_passes_kvseal(tmp_path: Path) -> None:
    # The incident: prefill's pool (512 tokens) is smaller than the window (1024). Normally the router refuses
    # to start; with the fault it only warns, and prompts between 512 and 1024 tokens walk on as placeholders.
    bad = Server([*FLEET, "--prefill-kv-pool-tokens", "512", "--test-faults", "incident"])
    try:
        bad.ready(300)
        assert "TEST FAULT INJECTION IS ON" in bad.output()
        rc_bad, rep_bad = _audit(bad.url, tmp_path / "bad.json")
    finally:
        bad.stop()
    assert rc_bad == 1, {k: rep_bad.get(k) for k in ("verdict", "leaks", "consistency", "canary_echo")}
    # what gave it away: long prompts answered 200 from a placeholder and stale pages no longer reflect their
    # own prompt (and may carry other users' secrets)
    assert {"long_prompts_ignored", "leak"} & set(rep_bad["violation_counts"]), rep_bad["violation_counts"]

    refused = Server([*FLEET, "--prefill-kv-pool-tokens", "512"])
    try:
        assert refused.wait_exit(300) != 0  # without the fault: seal 7 refuses this fleet outright
    finally:
        refused.stop()
    assert "refusing to start" in refused.output()

    good = Server(FLEET)
    try:
        good.ready(300)
        # --strict: a greedy prompt must answer the same under load as alone (the default arithmetic is batch
        # invariant), on top of no leak and every over-window prompt refused
        rc_good, rep_good = _audit(good.url, tmp_path / "good.json", strict=True)
    finally:
        good.stop()
    assert rc_good == 0, json.dumps(rep_good.get("violations", rep_good))[:3000]

"""`kvseal incidents` over the ledger of a real `kvseal serve` fleet: with the test-only incident fault it names
exactly the requests the fault turned into placeholders (the fault's own record, in the prefill worker's log), the
tenant affected and whose prompt KV was read; a clean fleet serving the same requests names none."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from kvseal.faults import PLACEHOLDER_RECORD
from tests.helpers.procs import Server, wait_until

pytestmark = pytest.mark.integration
MODEL = "SmolLM2-135M-Instruct"
# the decode pool (256 tokens, 16 pages) recycles within a few requests; the incident's prefill pool holds 128
FLEET = ["--max-model-len", "256", "--kv-pool-tokens", "256", "--max-num-batched-tokens", "256"]


def _keys(tmp: Path) -> Path:
    path = tmp / "keys.txt"
    path.write_text("acme sk-acme-1\nglobex sk-globex-1\n")
    return path


def _workload(url: str) -> list[str]:
    """Three acme prompts that fit everywhere, then two globex prompts over 128 tokens; returns the ids."""
    acme = openai.OpenAI(base_url=url + "/v1", api_key="sk-acme-1", max_retries=0, timeout=300)
    globex = openai.OpenAI(base_url=url + "/v1", api_key="sk-globex-1", max_retries=0, timeout=300)
    ids = []
    for i in range(3):
        ids.append(acme.completions.create(model=MODEL, prompt=[100 + i] * 70, max_tokens=8, temperature=0).id)
    for i in range(2):
        ids.append(globex.completions.create(model=MODEL, prompt=[300 + i] * 150, max_tokens=8, temperature=0).id)
    return ids


def _incidents(path: Path) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, "-m", "kvseal", "incidents", str(path), "--json"], capture_output=True,
                       text=True, timeout=120, check=False)
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else {"stderr": r.stderr}


def _router_rows(path: Path) -> int:
    if not path.exists():
        return 0
    db = sqlite3.connect(path)
    try:
        return int(db.execute("SELECT count(*) FROM requests WHERE role = 'router'").fetchone()[0])
    except sqlite3.Error:
        return 0
    finally:
        db.close()


def test_incidents_names_exactly_the_placeholders_and_nothing_on_a_clean_fleet(tmp_path: Path) -> None:
    bad_ledger = tmp_path / "incident.sqlite"
    bad = Server([*FLEET, "--prefill-kv-pool-tokens", "128", "--test-faults", "incident",
                  "--api-keys", str(_keys(tmp_path)), "--ledger", str(bad_ledger)])
    try:
        bad.ready(300)
        served = _workload(bad.url)
        wait_until(lambda: _router_rows(bad_ledger) == len(served), 30, "the router's ledger rows")
        record = set(re.findall(re.escape(PLACEHOLDER_RECORD) + r" (\S+)", bad.output()))
    finally:
        bad.stop()
    assert len(record) == 2 and record <= set(served), bad.output()[-3000:]
    rc, doc = _incidents(bad_ledger)
    assert rc == 1, doc
    named = {i["request_id"] for i in doc["incidents"]}
    assert named == record  # exactly the fault's own record: no more, no fewer
    assert doc["tenants_affected"] == ["globex"]
    assert all(i["role"] == "decode" and i["decode_worker"] and i["prefill_worker"] for i in doc["incidents"])
    # decode's freed pages were not scrubbed (the fault): the placeholders read acme's prompt KV
    sources = {(tenant, kind) for i in doc["incidents"] for _, tenant, kind, _ in i["sources"]}
    assert ("acme", "prompt") in sources, sources

    good_ledger = tmp_path / "clean.sqlite"
    good = Server([*FLEET, "--api-keys", str(_keys(tmp_path)), "--ledger", str(good_ledger)])
    try:
        good.ready(300)
        served = _workload(good.url)
        wait_until(lambda: _router_rows(good_ledger) == len(served), 30, "the router's ledger rows")
    finally:
        good.stop()
    rc, doc = _incidents(good_ledger)
    assert rc == 0 and doc["incidents"] == [] and doc["records"] >= 3 * len(served), doc

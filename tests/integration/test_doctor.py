"""`kvseal doctor ROUTER_URL` against a real fleet: healthy (exit 0) with a live probe through every pair, then a
worker the fleet check refused and a worker that died (exit 1, each named with its fix), then no router (exit 2)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
import pytest

from tests.helpers.fleet import LoopbackFleet, running
from tests.helpers.procs import Worker, wait_until

pytestmark = pytest.mark.integration
ARGS = ["--max-model-len", "512", "--kv-pool-tokens", "1024", "--max-num-batched-tokens", "128"]


def doctor(url: str) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-m", "kvseal", "doctor", url, "--timeout", "300"], capture_output=True,
                       text=True, timeout=900, check=False)
    return r.returncode, r.stdout + r.stderr


def states(fleet: LoopbackFleet) -> dict[str, str]:
    return {w["endpoint"]: w["state"] for w in httpx.get(fleet.router.url + "/info", timeout=30).json()["workers"]}


def test_doctor_on_a_good_fleet_then_a_refused_and_a_dead_worker_then_no_router() -> None:
    with running(lambda: LoopbackFleet(ARGS)) as fleet:  # type: ignore[arg-type, type-var]
        fleet_ep = httpx.get(fleet.router.url + "/info", timeout=30).json()["fleet_endpoint"].removeprefix("tcp://")
        second = Worker("prefill", [*ARGS, "--router", fleet_ep]).ready()
        fleet.extra.append(second)
        wait_until(lambda: states(fleet).get(f"tcp://{second.endpoint}") == "serving", 60, "the second prefill")

        rc, out = doctor(fleet.router.url)
        assert rc == 0, out
        rows = re.findall(r"^tcp://\S+ +(?:prefill|decode) +serving ", out, re.MULTILINE)
        assert len(rows) == 3 and "healthy" in out, out
        probes = re.findall(r"probe prefill (\S+) -> decode (\S+): 8 tokens in [\d.]+s (\[.*\])", out)
        assert {p for p, _, _ in probes} == {f"tcp://{fleet.prefill.endpoint}", f"tcp://{second.endpoint}"}, out
        assert len({tokens for _, _, tokens in probes}) == 1, out  # the same greedy tokens through both pairs

        refused = Worker("decode", [*ARGS, "--page-size", "32", "--router", fleet_ep])
        fleet.extra.append(refused)
        assert refused.wait_exit(180) == 3
        second.stop(signal.SIGKILL)
        wait_until(lambda: states(fleet).get(f"tcp://{second.endpoint}") == "lost", 60, "the dead prefill lost")
        rc, out = doctor(fleet.router.url)
        assert rc == 1, out
        assert f"decode tcp://{refused.endpoint} failed the fleet check" in out and "page_size" in out, out
        assert f"prefill tcp://{second.endpoint} is not reachable (lost)" in out, out
        assert out.count("fix: ") == 2, out
        assert len(re.findall(r"probe prefill .*: 8 tokens", out)) == 1, out  # the one pair left serving
        url = fleet.router.url
    rc, out = doctor(url)
    assert rc == 2 and "cannot read" in out, out

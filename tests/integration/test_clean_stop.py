"""A normal stop is quiet (issue 31): `kvseal serve`, having served a request, is stopped the two ways it is stopped
in practice, with SIGTERM to it alone (a service manager, `make serve` under one) or with Ctrl-C (SIGINT to its
whole process group, as a terminal sends it). It drains and stops its own workers, logs no ERROR line and no
traceback, and exits 0. The real processes, on loopback, with the bundled SmolLM2."""

from __future__ import annotations

import os
import signal

import httpx
import psutil
import pytest

from tests.helpers.procs import Server

pytestmark = [pytest.mark.integration, pytest.mark.e2e]
MODEL = "SmolLM2-135M-Instruct"
NOISE = (" ERROR ", " CRITICAL ", "Traceback", "Exception", "shutdown failed")


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_a_stopped_fleet_drains_its_workers_logs_no_error_and_exits_0(how: str) -> None:
    s = Server(["--max-model-len", "512", "--kv-pool-tokens", "1024"])
    try:
        s.ready(300)
        workers = psutil.Process(s.p.pid).children()
        assert len(workers) == 2
        r = httpx.post(s.url + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": "Count to three:", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        if how == "SIGTERM":
            s.p.send_signal(signal.SIGTERM)
        else:
            os.killpg(s.p.pid, signal.SIGINT)
        rc = s.wait_exit(90)
        log = s.output()
        assert [line for line in log.splitlines() if any(n in line for n in NOISE)] == [], log[-4000:]
        assert rc == 0, log[-4000:]
        # serve stopped its workers itself: each drained (none outlived it, none noticed it gone on its own)
        assert log.count("drained; exiting") == 2 and "parent process exited" not in log, log[-4000:]
        assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    finally:
        s.stop()

"""`kvseal serve --prefill 2 --decode 2`: the load spreads over every worker, and SIGTERM stops them all."""

from __future__ import annotations

import contextlib
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.helpers.procs import Server, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.e2e]
MODEL = "SmolLM2-135M-Instruct"


def test_two_by_two_spreads_load_and_stops_cleanly() -> None:
    s = Server(["--prefill", "2", "--decode", "2", "--max-model-len", "1024", "--kv-pool-tokens", "2048"])
    try:
        s.ready(300)
        children = psutil.Process(s.p.pid).children(recursive=True)
        assert len(children) == 4

        def ask(i: int) -> str:
            r = httpx.post(s.url + "/v1/completions", timeout=300, json={
                "model": MODEL, "prompt": f"Count to {i + 3}:", "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(ask, range(8)))
        info = httpx.get(s.url + "/info").json()
        workers = info["workers"]
        assert sorted(w["role"] for w in workers) == ["decode", "decode", "prefill", "prefill"]
        wait_until(lambda: all(w["requests_received"] >= 1 for w in httpx.get(s.url + "/info").json()["workers"]),
                   10, "every worker received work")
        s.p.send_signal(signal.SIGTERM)
        assert s.wait_exit(60) is not None
        wait_until(lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children), 30,
                   "every worker process stopped")
    finally:
        s.stop()


def test_workers_exit_when_serve_is_killed_while_they_load() -> None:
    # SIGKILL gives `kvseal serve` no chance to stop its workers; they must notice on their own, even when it
    # died before they finished loading the model (a worker must not sit orphaned holding its KV pool).
    s = Server(["--max-model-len", "512", "--kv-pool-tokens", "1024"])
    workers: list[psutil.Process] = []
    try:
        wait_until(lambda: len(psutil.Process(s.p.pid).children()) == 2, 60, "workers started")
        workers = psutil.Process(s.p.pid).children()
        s.p.kill()  # only serve itself, not its process group
        s.p.wait(30)

        def gone() -> bool:
            return not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)

        wait_until(gone, 180, "orphaned workers exited")
    finally:
        s.stop(signal.SIGKILL)
        for w in workers:  # when the test fails they are still there: do not leave them behind
            with contextlib.suppress(psutil.NoSuchProcess):
                w.kill()

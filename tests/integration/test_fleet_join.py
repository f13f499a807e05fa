"""Seal 7 at every join, with real processes: a worker that reconnects is checked in full before it gets a
request. Finding 1 of issue 10: a prefill worker restarted on the same port with a pool smaller than the served
window used to rejoin without a check, and a prompt inside the advertised window then got a 400 naming the
small pool. Now it stays out (log, /info with the reason) and the router answers 503 while no prefill worker
is left; a good restart on the same port is checked and serves again."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.helpers.fleet import LoopbackFleet, module_fleet
from tests.helpers.procs import Worker, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.e2e]
MODEL = "SmolLM2-135M-Instruct"
WINDOW = 1024
ARGS = ["--max-model-len", str(WINDOW), "--kv-pool-tokens", "2048", "--max-num-batched-tokens", "256"]


class Fleet(LoopbackFleet):
    def __init__(self) -> None:
        super().__init__(ARGS)
        self.client = openai.OpenAI(base_url=self.router.url + "/v1", api_key="x", max_retries=0, timeout=120)

    def restart_prefill(self, extra: list[str]) -> Worker:
        old = self.prefill
        old.stop(signal.SIGKILL)
        new = Worker("prefill", [*extra, "--port", str(old.port)])
        new.port, new.endpoint = old.port, old.endpoint
        self.prefill = new.ready()
        return new

    def worker_entries(self, role: str) -> list[dict]:
        return [w for w in httpx.get(self.router.url + "/info", timeout=10).json()["workers"] if w["role"] == role]


fleet = module_fleet(Fleet)


def test_a_restarted_worker_with_a_small_pool_stays_out_loudly(fleet: Fleet) -> None:
    prompt = "The river flows past the old mill. " * 70  # ~560 tokens: inside the window, over 512
    assert fleet.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4).usage.prompt_tokens > 512
    fleet.restart_prefill(["--max-model-len", str(WINDOW), "--kv-pool-tokens", "512"])
    # once the router has read the new process's /info (its pool of 512 tokens) ...
    wait_until(lambda: fleet.worker_entries("prefill")[0].get("pool_tokens") == 512, 30, "the router saw the restart")
    # ... the only prefill worker is out: a 503 at once, never the small pool's 400 for a prompt inside the window
    r = httpx.post(fleet.router.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
                   timeout=120)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "no_worker" and "no prefill worker" in r.json()["error"]["message"]
    assert r.headers["retry-after"]
    assert fleet.prefill.info()["requests_received"] == 0  # it never got a request
    wait_until(lambda: fleet.worker_entries("prefill")[0]["state"] == "refused", 10, "the worker refused")
    (entry,) = fleet.worker_entries("prefill")
    assert "holds 512 tokens" in entry["reason"] and "1024-token context window" in entry["reason"], entry
    assert "--kv-pool-tokens 1024" in entry["reason"], entry
    assert "refused" in fleet.router.output() and "holds 512 tokens" in fleet.router.output()
    assert httpx.get(fleet.router.url + "/health", timeout=10).status_code == 503

    # restarted again with a pool that holds the window: checked, back in rotation, serves the long prompt
    fleet.restart_prefill(ARGS)
    wait_until(lambda: fleet.worker_entries("prefill")[0]["state"] == "serving", 30, "prefill back in rotation")
    ok = fleet.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def _fleet_endpoint(fleet: Fleet) -> str:
    ep = httpx.get(fleet.router.url + "/info", timeout=10).json()["fleet_endpoint"]
    assert ep and ep.startswith("tcp://")
    return str(ep).removeprefix("tcp://")


def test_a_worker_joins_a_running_router_through_the_same_check(fleet: Fleet) -> None:
    ep = _fleet_endpoint(fleet)
    # test faults that differ from the router's (none): refused, and the worker exits with the reason
    faulty = Worker("decode", [*ARGS, "--router", ep, "--test-faults", "flip_byte"])
    assert faulty.wait_exit(120) == 3, faulty.output()[-3000:]
    assert "refused this worker" in faulty.output() and "test faults 'flip_byte'" in faulty.output()
    entry = next(w for w in fleet.worker_entries("decode") if w["endpoint"].endswith(f":{faulty.port}"))
    assert entry["state"] == "refused" and entry["registered"] and "test faults" in entry["reason"], entry

    joined = Worker("decode", [*ARGS, "--router", ep]).ready()
    fleet.extra.append(joined)
    wait_until(lambda: "admitted this worker" in joined.output(), 60, "the router admitted the worker")
    entry = next(w for w in fleet.worker_entries("decode") if w["endpoint"].endswith(f":{joined.port}"))
    assert entry["state"] == "serving" and entry["registered"], entry
    # it gets requests: two at once go to the two least-loaded decode workers (ties at random)
    for _ in range(10):
        with ThreadPoolExecutor(2) as pool:
            rs = list(pool.map(lambda _: fleet.client.completions.create(model=MODEL, prompt="Hi", max_tokens=8),
                               range(2)))
        assert all(r.choices[0].finish_reason == "length" for r in rs)
        if joined.info()["requests_received"] > 0:
            break
    assert joined.info()["requests_received"] > 0


def test_drain_finishes_the_requests_in_flight_before_the_worker_leaves(fleet: Fleet) -> None:
    import subprocess
    import sys

    for how, worker in (("kvseal drain", None), ("SIGTERM", None)):
        # 600 tokens: long enough to still be in flight when the drain arrives (80 could finish first)
        body = {"model": MODEL, "prompt": "Write a long story about a lighthouse.", "max_tokens": 600,
                "temperature": 0, "ignore_eos": True, "stream": True}
        text: list[str] = []
        with httpx.stream("POST", fleet.router.url + "/v1/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    text.append(line)
                    break
            decodes = [w for w in [fleet.decode, *fleet.extra] if isinstance(w, Worker) and w.p.poll() is None]
            worker = next(w for w in decodes if w.info()["running"] > 0)
            if how == "kvseal drain":
                out = subprocess.run([sys.executable, "-m", "kvseal", "drain", worker.endpoint], capture_output=True,
                                     text=True, timeout=60, check=False)
                assert out.returncode == 0 and "is draining: 1 request(s)" in out.stdout, out.stdout + out.stderr
            else:
                worker.p.send_signal(signal.SIGTERM)
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]  # the request in flight finished whole
        usage_done = [json.loads(e) for e in events[:-1]]
        assert usage_done[-1]["choices"][0]["finish_reason"] == "length"
        assert worker.wait_exit(60) == 0, worker.output()[-2000:]
        assert "drained; exiting" in worker.output()
        wait_until(lambda w=worker: next(e for e in fleet.worker_entries("decode") if e["endpoint"].endswith(
            f":{w.port}"))["state"] in ("left", "draining"), 30, f"the router saw the {how} worker leave")
    # no decode worker left: 503 with the reason at once, not a hang
    r = httpx.post(fleet.router.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker", r.text

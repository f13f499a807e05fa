"""A busy prefill queue is not a transfer timeout: while a prompt waits or computes on prefill, the router keeps
decode's reservation alive; the handoff itself is still bounded by decode's reservation timeout (the stalled
transfer test in test_faults.py). Real router, prefill and decode processes on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.procs import Server, Worker, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.e2e]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Server, Worker, Worker]]:
    # prefill computes 16 tokens a step, so twelve ~300-token prompts keep the last one queued for many times
    # decode's 0.5 s reservation timeout (~12 ms a step with the fast kernels: six prompts were not enough)
    args = ["--max-model-len", "1024", "--kv-pool-tokens", "8192"]
    prefill = Worker("prefill", [*args, "--max-num-batched-tokens", "16"]).ready()
    decode = Worker("decode", [*args, "--reservation-timeout", "0.5"]).ready()
    router = Server(["--prefill", prefill.endpoint, "--decode", decode.endpoint], command="router").ready()
    try:
        yield router, prefill, decode
    finally:
        for p in (router, prefill, decode):
            p.stop()


def test_queued_prefill_outlives_the_reservation_timeout(fleet: tuple[Server, Worker, Worker]) -> None:
    router, prefill, decode = fleet
    prompts = [f"Story {i}: " + "the river runs to the sea and " * 40 for i in range(12)]

    def one(prompt: str) -> httpx.Response:
        return httpx.post(router.url + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, prompts))
    assert [r.status_code for r in results] == [200] * len(prompts), [r.text for r in results]
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in results)
    assert min(r.json()["usage"]["prompt_tokens"] for r in results) > 250
    # every request took several reservation timeouts end to end, yet none expired
    assert max(r.elapsed.total_seconds() for r in results) > 1.5
    wait_until(lambda: decode.info()["reservations"] == 0 and decode.info()["free_pages"] ==
               decode.info()["pool_pages"] and prefill.info()["free_pages"] == prefill.info()["pool_pages"],
               20, "pools back to baseline")

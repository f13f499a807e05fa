"""The incident of ../shared/incident.md, scaled to SmolLM2 (8,192-token window), against real processes.

The incident's prefill pool / window ratio, 681,280 / 1,048,576, gives a prefill pool of 5,322 tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.helpers.procs import Server, Worker

pytestmark = [pytest.mark.integration, pytest.mark.e2e]
INCIDENT_POOL = 5322
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def small_prefill() -> Iterator[Worker]:
    w = Worker("prefill", ["--kv-pool-tokens", str(INCIDENT_POOL)])
    try:
        yield w.ready()
    finally:
        w.stop()


@pytest.fixture(scope="module")
def decode() -> Iterator[Worker]:
    w = Worker("decode", ["--kv-pool-tokens", "16384"])
    try:
        yield w.ready()
    finally:
        w.stop()


def test_router_refuses_to_start_when_a_pool_is_smaller_than_the_window(small_prefill: Worker,
                                                                          decode: Worker) -> None:
    pool = small_prefill.info()["pool_tokens"]
    assert 5300 < pool <= INCIDENT_POOL  # whole pages of 16
    router = Server(["--prefill", small_prefill.endpoint, "--decode", decode.endpoint], command="router")
    try:
        rc = router.wait_exit(120)
    finally:
        router.stop()
    out = router.output()
    assert rc != 0, out
    assert "refusing to start" in out and "Traceback" not in out, out
    assert f"holds {pool} tokens" in out and "8192-token context window" in out, out
    assert "--kv-pool-tokens 8192" in out and f"--max-model-len {pool}" in out, out


@pytest.mark.parametrize(("flags", "theirs", "ours"), [
    (["--page-size", "32"], "page_size=32", "page_size=16"),
    # KV from torch's kernels is valid for native ones only up to rounding: disaggregated output would
    # drift from unified output in the last bits, so the fleet must agree
    (["--kernels", "torch"], "kernels='torch'", "kernels='native'"),
    # the exact arithmetic computes other KV than the fast one (and lays it out otherwise)
    (["--arithmetic", "exact"], "arithmetic='exact/native'", "arithmetic='fast/int8'"),
    (["--kv-dtype", "float32"], "kv_dtype='float32'", "kv_dtype='bfloat16'"),  # auto: bfloat16 under fast
])
def test_router_refuses_workers_that_disagree_on_layout_or_kernels(small_prefill: Worker, flags: list[str],
                                                                    theirs: str, ours: str) -> None:
    other = Worker("decode", ["--kv-pool-tokens", "16384", *flags]).ready()
    router = Server(["--prefill", small_prefill.endpoint, "--decode", other.endpoint, "--max-model-len", "4096"],
                    command="router")
    try:
        rc = router.wait_exit(120)
    finally:
        router.stop()
        other.stop()
    out = router.output()
    assert rc != 0 and theirs in out and ours in out, out


def test_window_lowered_to_fit_rejects_before_any_worker(small_prefill: Worker, decode: Worker) -> None:
    pool = small_prefill.info()["pool_tokens"]
    router = Server(["--prefill", small_prefill.endpoint, "--decode", decode.endpoint,
                     "--max-model-len", str(pool)], command="router").ready()
    try:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=300)
        seen = (small_prefill.info()["requests_received"], decode.info()["requests_received"])
        moved = (small_prefill.info()["kv_bytes_sent"], decode.info()["kv_bytes_received"])
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=[42] * 6000, max_tokens=4)
        assert e.value.code == "context_length_exceeded" and str(pool) in e.value.message
        with pytest.raises(openai.BadRequestError):  # streamed: still a 400, never a 200
            client.completions.create(model=MODEL, prompt=[42] * 6000, max_tokens=4, stream=True)
        # no worker saw it, no KV byte moved
        assert (small_prefill.info()["requests_received"], decode.info()["requests_received"]) == seen
        assert (small_prefill.info()["kv_bytes_sent"], decode.info()["kv_bytes_received"]) == moved
        ok = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0)
        assert ok.choices[0].finish_reason == "length"
    finally:
        router.stop()

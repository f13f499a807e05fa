"""The sealed handoff against real processes: bad KV is refused (seal 4), a prefill refusal reaches the
client with its original error and moves no KV (seal 3), pools return to baseline (seal 8), and greedy
output of the disaggregated path equals the unified engine token for token (seal 10). Every test runs once
per KV transport: ZeroMQ (a packed copy) and NIXL over UCX (decode reads into its reserved pages)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from kvseal import LLM, SamplingParams
from kvseal.model.checkpoint import Checkpoint
from tests.helpers.fleet import LoopbackFleet, running
from tests.helpers.procs import FaultFile, wait_until
from tests.helpers.transports import KV_TRANSPORTS

pytestmark = [pytest.mark.integration, pytest.mark.e2e]
MODEL = "SmolLM2-135M-Instruct"
ARGS = ["--max-model-len", "2048", "--kv-pool-tokens", "4096", "--max-num-batched-tokens", "128"]


class Fleet(LoopbackFleet):
    faults: FaultFile

    def __init__(self, kv_transport: str) -> None:
        super().__init__([*ARGS, "--kv-transport", kv_transport], faults=True)


@pytest.fixture(scope="module", params=KV_TRANSPORTS)
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    with running(lambda: Fleet(request.param)) as f:
        assert f.decode.info()["kv_transport"] == f.prefill.info()["kv_transport"] == request.param
        yield f


@pytest.mark.parametrize("fault", ["short_pages", "short_tokens", "wrong_nonce", "wrong_request_id", "flip_byte"])
@pytest.mark.parametrize("stream", [False, True])
def test_decode_refuses_kv_that_is_not_what_it_reserved(fleet: Fleet, fault: str, stream: bool) -> None:
    before = fleet.decode.info()
    fleet.faults.set(fault, fleet.prefill)
    try:
        with pytest.raises(openai.APIStatusError) as e:
            r = fleet.client.completions.create(model=MODEL, prompt="Tell me a story about a dragon.",
                                                max_tokens=8, temperature=0, stream=stream)
            list(r) if stream else None
    finally:
        fleet.faults.set("", fleet.prefill)
    assert e.value.status_code == 502, e.value
    assert e.value.code == "kv_verification_failed"
    # logged where it ended: in the handoff (before: stage=decoding, the router had moved on at the error delta)
    rid = e.value.response.headers["x-request-id"]
    wait_until(lambda: [x for x in fleet.router.output().splitlines() if rid in x], 10, "the failure logged")
    line = next(x for x in fleet.router.output().splitlines() if rid in x)
    assert "stage=transferring" in line, line
    after = fleet.decode.info()
    assert after["transfers_refused"] == before["transfers_refused"] + 1
    assert after["transfers_acked"] == before["transfers_acked"]
    wait_until(fleet.at_baseline, 30, "pools back to baseline")
    ok = fleet.client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_prefill_refusal_reaches_client_with_its_error_and_moves_nothing(fleet: Fleet) -> None:
    p0, d0 = fleet.prefill.info(), fleet.decode.info()
    fleet.faults.set("prefill_reject_over=20", fleet.prefill)
    try:
        with pytest.raises(openai.BadRequestError) as e:
            fleet.client.completions.create(model=MODEL, prompt="word " * 60, max_tokens=4)
    finally:
        fleet.faults.set("", fleet.prefill)
    assert e.value.code == "prefill_policy" and "prefill worker policy refused" in e.value.message
    p1, d1 = fleet.prefill.info(), fleet.decode.info()
    assert d1["requests_received"] == d0["requests_received"] + 1  # decode did reserve ...
    assert p1["kv_bytes_sent"] == p0["kv_bytes_sent"]  # ... but no KV byte moved
    assert d1["kv_bytes_received"] == d0["kv_bytes_received"]
    wait_until(lambda: fleet.decode.info()["reservations"] == 0, 10, "reservation released")
    wait_until(fleet.at_baseline, 30, "pools back to baseline")
    ended = httpx.get(fleet.router.url + "/info").json()["ended"]
    assert ended["rejected"] >= 1


def _prompts(ck: Checkpoint) -> list[list[int]]:
    tok = ck.tokenizer
    texts = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain what a CPU cache is.", " ".join(f"item {i} costs {i * 3} coins;" for i in range(50))]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False)
            for t in texts]


def test_disaggregated_equals_unified_token_for_token(fleet: Fleet, smol: Checkpoint) -> None:
    prompts = _prompts(smol)
    assert max(len(p) for p in prompts) > 300  # several prefill chunks
    unified = LLM(checkpoint=smol, max_model_len=2048, pool_tokens=4096)
    ref = [o.outputs[0].token_ids for o in unified.generate(prompts, SamplingParams(max_tokens=24, temperature=0,
                                                                                     ignore_eos=True))]

    def disagg(ids: list[int]) -> list[int]:
        r = httpx.post(fleet.router.url + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    alone = [disagg(ids) for ids in prompts]
    with ThreadPoolExecutor(len(prompts) * 2) as pool:
        together = list(pool.map(disagg, prompts * 2))
    expected = ref
    assert alone == expected
    assert together == expected * 2
    wait_until(fleet.at_baseline, 30, "pools back to baseline")

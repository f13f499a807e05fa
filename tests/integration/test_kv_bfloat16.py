"""--kv-dtype bfloat16 across real processes: the handoff moves half the bytes, decode still verifies every page
(seal 4), greedy output of the disaggregated fleet equals the unified engine with the same KV dtype token for
token (seal 10), and freed pages are zeroed (seal 6)."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvseal import LLM, SamplingParams
from kvseal.kv.allocator import pages_for
from kvseal.model.checkpoint import Checkpoint
from tests.helpers.fleet import LoopbackFleet, module_fleet
from tests.helpers.procs import FaultFile, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.e2e]
MODEL = "SmolLM2-135M-Instruct"
ARGS = ["--max-model-len", "1024", "--kv-pool-tokens", "2048", "--kv-dtype", "bfloat16"]


class Fleet(LoopbackFleet):
    faults: FaultFile

    def __init__(self) -> None:
        super().__init__(ARGS, faults=True)


fleet = module_fleet(Fleet)


def _complete(fleet: Fleet, ids: list[int]) -> httpx.Response:
    return httpx.post(fleet.router.url + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})


def test_bfloat16_handoff_equals_unified_and_moves_half_the_bytes(fleet: Fleet, smol: Checkpoint) -> None:
    info = fleet.decode.info()
    assert info["kv_dtype"] == "bfloat16" and info["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2
    tok = smol.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in ("Write a haiku about the sea.", "Explain what a CPU cache is. " * 12)]
    unified = LLM(checkpoint=smol, max_model_len=1024, pool_tokens=2048, kv_dtype="bfloat16")
    ref = [o.outputs[0].token_ids for o in unified.generate(prompts, SamplingParams(max_tokens=16, temperature=0,
                                                                                     ignore_eos=True))]
    before = fleet.decode.info()["kv_bytes_received"]
    got = []
    for ids in prompts:
        r = _complete(fleet, ids)
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["token_ids"])
    assert got == ref
    pages = sum(pages_for(len(p), 16) for p in prompts)
    moved = fleet.decode.info()["kv_bytes_received"] - before
    assert moved == pages * 16 * 30 * 2 * 3 * 64 * 2  # bfloat16: 2 bytes a value, every page of every layer
    wait_until(fleet.at_baseline, 30, "pools back to baseline")


@pytest.mark.parametrize("fault", ["flip_byte", "short_pages"])
def test_bfloat16_kv_that_is_not_what_was_reserved_is_refused(fleet: Fleet, fault: str) -> None:
    client = openai.OpenAI(base_url=fleet.router.url + "/v1", api_key="x", max_retries=0, timeout=300)
    fleet.faults.set(fault, fleet.prefill)
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=MODEL, prompt="Tell me a story about a dragon.", max_tokens=8,
                                      temperature=0)
    finally:
        fleet.faults.set("", fleet.prefill)
    assert e.value.status_code == 502 and e.value.code == "kv_verification_failed"
    wait_until(fleet.at_baseline, 30, "pools back to baseline")

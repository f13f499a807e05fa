"""One tenant's slow response_format does not stall another tenant's stream (issue 17 section 3).

Alice streams greedy tokens (from a disaggregated fleet, and from one unified process) while Bob sends a 41-byte
schema whose grammar takes seconds to compile. Grammars compile in killable processes off the workers' loops, so
Alice's worst gap while Bob's compile runs stays within 3 of her own decode steps (her median gap in the same
stream; on a host busy with other work, within twice the worst gap her stream shows outside Bob's compile; never
less than a fifth of the compile limit, as Bob's compiler process takes one of two cores), and Bob gets a 400
naming response_format when his compile passes the limit. A compile on a worker's loop would stall her for the
whole compile.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from tests.helpers.procs import Server

pytestmark = [pytest.mark.e2e, pytest.mark.serial]  # serial: measures time (scripts/test.sh)
MODEL = "SmolLM2-135M-Instruct"
KEYS = {"alice": "sk-alice-structured-0001", "bob": "sk-bob-structured-0002"}
SLOW = {"type": "json_schema", "json_schema": {"name": "digits",
                                              "schema": {"type": "string", "pattern": "[0-9]{8000}"}}}
TIMEOUT_S = 1.5  # --grammar-timeout: the slow schema takes longer than this to compile, whatever the machine


@pytest.fixture(scope="module", params=["disaggregated", "unified"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
    mode = ["--unified"] if request.param == "unified" else []
    s = Server([*mode, "--max-model-len", "1024", "--kv-pool-tokens", "4096", "--api-keys", str(keys),
                "--grammar-timeout", str(TIMEOUT_S), "--grammar-compilers", "1"])
    try:
        yield s.ready()
    finally:
        s.stop()


def client(server: Server, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=120)


def test_a_slow_schema_of_one_tenant_does_not_stall_another_tenants_stream(server: Server) -> None:
    alice, bob = client(server, "alice"), client(server, "bob")
    # Bob's first constrained chat starts the workers' compiler processes (and the router's chat template); what
    # is measured is a compile
    warm = bob.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                       response_format={"type": "json_object"},
                                       messages=[{"role": "user", "content": "A JSON object, please."}])
    assert (warm.choices[0].message.content or "").startswith("{")

    arrivals: list[float] = []
    window: list[float] = []
    refusal: list[openai.BadRequestError] = []

    def bob_sends_the_slow_schema() -> None:
        while len(arrivals) < 60:
            time.sleep(0.005)
        window.append(time.perf_counter())
        try:
            bob.chat.completions.create(model=MODEL, max_tokens=8, response_format=SLOW,  # type: ignore[arg-type]
                                        messages=[{"role": "user", "content": "Eight thousand digits, please."}])
        except openai.BadRequestError as err:
            refusal.append(err)
        window.append(time.perf_counter())

    bobs = threading.Thread(target=bob_sends_the_slow_schema, daemon=True)
    bobs.start()
    stream = alice.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=300, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
    bobs.join(60)

    assert refusal, "bob's schema compiled within the limit or was not refused"
    err = refusal[0]
    assert err.status_code == 400 and err.param == "response_format" and "took longer" in err.message
    start, end = window
    assert end - start >= TIMEOUT_S  # his compile ran its full time while alice streamed
    gaps = list(itertools.pairwise(arrivals))
    median = statistics.median(b - a for a, b in gaps)
    during = [b - a for a, b in gaps if b > start and a < end]
    assert len(during) >= 10, f"alice's stream did not span bob's compile ({len(arrivals)} tokens)"
    outside = [b - a for a, b in gaps if b <= start or a >= end]
    assert len(outside) >= 50, f"too few of alice's tokens outside bob's compile ({len(outside)})"
    # A step is alice's median gap: at most 3 of them. A host busy with other work stalls her stream now and then
    # whatever bob does; that jitter, seen outside bob's window in the same stream, widens the budget to twice the
    # worst gap there. Bob's compiler process burns a whole core for the whole window, and on 2 cores it competes
    # with the router and both workers: CI saw a 41 ms gap with an 8 ms median and 15 ms outside. None of that is a
    # stall of her loop; a compile on a worker's loop would stall her for the whole compile (at least TIMEOUT_S), so
    # the budget never goes below a fifth of it, still five times short of what the broken design does.
    budget = max(3 * median, 2 * max(outside), TIMEOUT_S / 5)
    worst = max(during)
    at = next(a - start for a, b in gaps if b - a == worst)
    assert worst <= budget, (f"alice stalled {worst * 1000:.0f} ms during bob's compile; her median step "
                             f"{median * 1000:.0f} ms, her worst gap outside it {max(outside) * 1000:.0f} ms; "
                             f"it began {at:.2f} s into bob's {end - start:.2f} s")

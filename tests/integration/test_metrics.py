"""Prometheus /metrics on the router and on every worker, scraped from real processes: the right counters move for a
finished request, a 400, an injected verification failure, and a worker the fleet check refuses."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.fleet import LoopbackFleet, running
from tests.helpers.procs import FaultFile, Worker, wait_until

pytestmark = pytest.mark.integration
MODEL = "SmolLM2-135M-Instruct"
ARGS = ["--max-model-len", "512", "--kv-pool-tokens", "1024", "--max-num-batched-tokens", "128"]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text[:300]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


class Fleet(LoopbackFleet):
    faults: FaultFile

    def __init__(self) -> None:
        super().__init__(ARGS, faults=True)  # every process of the fleet on the same runtime test faults
        self.client = openai.OpenAI(base_url=self.router.url + "/v1", api_key="x", max_retries=0, timeout=300)
        self.router_metrics = self.router.url + "/metrics"
        self.prefill_metrics = str(self.prefill.info()["metrics_endpoint"])
        self.decode_metrics = str(self.decode.info()["metrics_endpoint"])

    def all(self) -> tuple[Samples, Samples, Samples]:
        return scrape(self.router_metrics), scrape(self.prefill_metrics), scrape(self.decode_metrics)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with running(Fleet) as f:
        yield f


def test_a_finished_request_moves_tokens_latencies_scrubs_and_transfers(fleet: Fleet) -> None:
    r0, p0, d0 = fleet.all()
    out = fleet.client.completions.create(model=MODEL, prompt=[42] * 40, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    wait_until(lambda: fleet.at_baseline(), 30, "the fleet back at baseline")
    r1, p1, d1 = fleet.all()
    assert value(r1, "kvseal:request_success_total", finished_reason="length") == \
        value(r0, "kvseal:request_success_total", finished_reason="length") + 1
    assert value(r1, "kvseal:prompt_tokens_total") - value(r0, "kvseal:prompt_tokens_total") == 40
    assert value(r1, "kvseal:generation_tokens_total") - value(r0, "kvseal:generation_tokens_total") == 5
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert value(r1, f"kvseal:{hist}_count") == value(r0, f"kvseal:{hist}_count") + 1, hist
    assert value(r1, "kvseal:inter_token_latency_seconds_count") - \
        value(r0, "kvseal:inter_token_latency_seconds_count") == 4  # 5 tokens: 4 gaps
    assert value(r1, "kvseal:router_requests_running") == value(r1, "kvseal:router_requests_waiting") == 0
    assert value(p1, "kvseal:kv_transfers_total", result="acked") == value(p0, "kvseal:kv_transfers_total",
                                                                          result="acked") + 1
    assert value(p1, "kvseal:kv_transfer_seconds_count") == value(p0, "kvseal:kv_transfer_seconds_count") + 1
    moved = value(d1, "kvseal:kv_transfer_bytes_total", direction="received") - \
        value(d0, "kvseal:kv_transfer_bytes_total", direction="received")
    assert moved > 0 and moved == value(p1, "kvseal:kv_transfer_bytes_total", direction="sent") - \
        value(p0, "kvseal:kv_transfer_bytes_total", direction="sent")
    # after the ack prefill kept the prompt's 2 full pages in its prefix cache and scrubbed the partial third;
    # decode scrubbed the 3 pages that held 44 tokens
    assert value(p1, "kvseal:cached_pages") - value(p0, "kvseal:cached_pages") == 2
    assert value(p1, "kvseal:pages_scrubbed_total") - value(p0, "kvseal:pages_scrubbed_total") == 1
    assert value(d1, "kvseal:pages_scrubbed_total") - value(d0, "kvseal:pages_scrubbed_total") == 3
    assert value(d1, "kvseal:kv_cache_usage_perc") == 0.0
    assert (value(p1, "kvseal:request_queue_time_seconds_count")
            == value(p0, "kvseal:request_queue_time_seconds_count") + 1)
    assert value(d1, "kvseal:ownership_check_failures_total") == 0
    (labels,) = [dict(k) for (n, k), v in d1.items() if n == "kvseal:worker_info" and v == 1]
    info = fleet.decode.info()
    assert labels == {"role": "decode", "endpoint": info["control_endpoint"], "test_faults": info["test_faults"],
                      **{k: str(info[k]) for k in ("model_fingerprint", "page_size", "kv_dtype", "kv_layout",
                                                   "kernels", "arithmetic")}}


def test_a_400_counts_as_a_refusal_by_reason_and_reaches_no_worker(fleet: Fleet) -> None:
    r0, p0, d0 = fleet.all()
    with pytest.raises(openai.BadRequestError):
        fleet.client.completions.create(model=MODEL, prompt=[42] * 600, max_tokens=4)
    r1, p1, d1 = fleet.all()
    assert value(r1, "kvseal:request_errors_total", status="400", code="context_length_exceeded") == \
        value(r0, "kvseal:request_errors_total", status="400", code="context_length_exceeded") + 1
    assert sum(v for (n, _), v in r1.items() if n == "kvseal:request_success_total") == \
        sum(v for (n, _), v in r0.items() if n == "kvseal:request_success_total")
    for before, after in ((p0, p1), (d0, d1)):
        assert value(after, "kvseal:requests_received_total") == value(before, "kvseal:requests_received_total")


def test_an_injected_verification_failure_is_counted_by_field(fleet: Fleet) -> None:
    r0, _, d0 = fleet.all()
    fleet.faults.set("flip_byte", fleet.prefill, fleet.decode)
    try:
        with pytest.raises(openai.APIStatusError) as e:
            fleet.client.completions.create(model=MODEL, prompt=[7] * 20, max_tokens=3)
        assert e.value.status_code == 502
    finally:
        fleet.faults.set("", fleet.prefill, fleet.decode)
    r1, _, d1 = fleet.all()
    assert value(d1, "kvseal:kv_verification_failures_total", field="page_checksums") == \
        value(d0, "kvseal:kv_verification_failures_total", field="page_checksums") + 1
    assert value(d1, "kvseal:kv_transfers_total", result="refused") == \
        value(d0, "kvseal:kv_transfers_total", result="refused") + 1
    assert value(r1, "kvseal:request_errors_total", status="502", code="kv_verification_failed") == \
        value(r0, "kvseal:request_errors_total", status="502", code="kv_verification_failed") + 1
    wait_until(lambda: fleet.at_baseline(), 30, "the fleet back at baseline")


def test_a_refused_worker_is_counted_and_stays_out_of_rotation(fleet: Fleet) -> None:
    r0 = scrape(fleet.router_metrics)
    assert value(r0, "kvseal:workers_in_rotation", role="decode") == 1
    ep = httpx.get(fleet.router.url + "/info", timeout=10).json()["fleet_endpoint"].removeprefix("tcp://")
    other = Worker("decode", [*ARGS, "--page-size", "32", "--router", ep, *fleet.faults.args()])
    fleet.extra.append(other)
    assert other.wait_exit(180) == 3  # refused: it exits with the reason
    r1 = scrape(fleet.router_metrics)
    assert value(r1, "kvseal:fleet_check_refusals_total", role="decode") == \
        value(r0, "kvseal:fleet_check_refusals_total", role="decode") + 1
    assert value(r1, "kvseal:workers", role="decode", standing="refused") == 1
    assert value(r1, "kvseal:workers_in_rotation", role="decode") == 1
    assert value(r1, "kvseal:workers", role="decode", standing="serving") == 1

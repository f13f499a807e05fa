"""The endpoint picker's configuration in docs/deploy.md (Gateway API Inference Extension) names gauges that a
worker's metrics port serves to a scrape without a key, as the picker scrapes, with the meaning of the picker's
model-server protocol: queued requests, running requests, KV-cache utilisation from 0 to 1, and the page size as
the block-size label. Scraped over real loopback HTTP from a worker's metrics server on the tiny model."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvseal.metrics.engine import EngineCollector, WorkerMetrics
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire.messages import GenerateRequest, SamplingParams

from .conftest import make_engine

DEPLOY = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"


def picker_extractor() -> dict[str, Any]:
    """The engine config docs/deploy.md gives the picker's core-metrics-extractor (its defaultEngine's)."""
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", DEPLOY.read_text(), re.DOTALL)]
    (config,) = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "EndpointPickerConfig"]
    (extractor,) = [p["parameters"] for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = [c for c in extractor["engineConfigs"] if c["name"] == extractor["defaultEngine"]]
    return engine


def test_the_pickers_config_names_gauges_a_worker_serves_without_a_key(tiny: Checkpoint) -> None:
    spec = picker_extractor()
    e = make_engine(tiny, pool_tokens=256, page_size=4, budget=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(5):  # a step's 16 tokens admit a 12-token prompt and a chunk of the next: the rest wait
        e.add_request(GenerateRequest(f"r{i}", [2 + i] * 12, params, tenant="acme"))
    e.step()
    running, waiting = len(e.scheduler.running), len(e.scheduler.waiting)
    assert running >= 1 and waiting >= 1 and running != waiting  # so neither gauge can pass for the other
    url = WorkerMetrics(EngineCollector(e)).serve("127.0.0.1", 0, hashlib.sha256(b"a-metrics-token").hexdigest())
    r = httpx.get(url, timeout=10)  # no Authorization: what the picker gets
    assert r.status_code == 200
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}

    def gauge(name: str) -> float:
        fam = fams[name]
        assert fam.type == "gauge", (name, fam.type)  # the protocol's gauges
        (sample,) = fam.samples
        return float(sample.value)

    assert gauge(spec["queuedRequestsSpec"]) == waiting
    assert gauge(spec["runningRequestsSpec"]) == running
    usage = gauge(spec["kvUsageSpec"])
    assert 0 < usage <= 1 and usage == 1 - e.allocator.num_free / e.pool.num_pages
    # the block size: a label of an info-style gauge, as vllm:cache_config_info carries block_size
    assert gauge(spec["cacheInfoSpec"]) == 1
    (sample,) = fams[spec["cacheInfoSpec"]].samples
    assert sample.labels[spec["cacheBlockSizeLabelName"]] == str(e.pool.page_size) == "4"

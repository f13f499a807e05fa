"""Per-tenant figures on the router's /metrics (admin keys only, as all of /metrics):

    kvseal:tenant_prompt_tokens_total{tenant}        prompt tokens of its requests that got a first token
    kvseal:tenant_generation_tokens_total{tenant}    output tokens as they stream (live: a backlog's split shows)
    kvseal:tenant_time_to_first_token_seconds{tenant}  histogram, as measured at the router
    kvseal:tenant_rate_limited_total{tenant,type}    429s by type (requests: rpm or max_concurrent; tokens: tpm)
    kvseal:tenant_requests_in_flight{tenant}         completion requests of tenants with limits
    kvseal:tenant_weight{tenant}                     its weight from the tenants file

Each engine adds its own (engine tokens served, queue time, KV pages held, VTC counter: metrics/engine.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvseal.config import TenantPolicy
from kvseal.tenancy.state import Limits

TTFT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class TenantCounters:
    """What MeteredBackend observes per tenant."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.prompt_tokens = Counter("kvseal:tenant_prompt_tokens", "Prompt tokens of a tenant's requests that got "
                                     "a first token", ["tenant"], registry=registry)
        self.generation_tokens = Counter("kvseal:tenant_generation_tokens", "A tenant's output tokens, counted as "
                                         "they stream", ["tenant"], registry=registry)
        self.ttft = Histogram("kvseal:tenant_time_to_first_token_seconds", "A tenant's time to first token",
                              ["tenant"], buckets=TTFT_BUCKETS, registry=registry)


class LimitsCollector(Collector):
    """The router's limits and the tenants file's weights, read at scrape time."""

    def __init__(self, limiter: Limits, policies: dict[str, TenantPolicy]) -> None:
        self.limiter, self.policies = limiter, policies

    def collect(self) -> Iterator[Any]:
        refused = CounterMetricFamily("kvseal:tenant_rate_limited", "429s by tenant and type",
                                      labels=["tenant", "type"])
        flight = GaugeMetricFamily("kvseal:tenant_requests_in_flight", "Completion requests in flight (tenants with "
                                   "limits)", labels=["tenant"])
        for tenant, f in sorted(self.limiter.figures().items()):
            refused.add_metric([tenant, "requests"], f["rate_limited_requests"])
            refused.add_metric([tenant, "tokens"], f["rate_limited_tokens"])
            flight.add_metric([tenant], f["in_flight"])
        weight = GaugeMetricFamily("kvseal:tenant_weight", "A tenant's weight from the tenants file", labels=["tenant"])
        for tenant, p in sorted(self.policies.items()):
            weight.add_metric([tenant], p.weight)
        yield refused
        yield flight
        yield weight

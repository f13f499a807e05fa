"""The router's embedding figures, on its /metrics (admin keys only, as every per-tenant figure there).

    kvseal:embedding_requests_total, kvseal:embedding_inputs_total, kvseal:embedding_tokens_total
    kvseal:embedding_request_latency_seconds        arrival to answer, of requests answered
    kvseal:tenant_embedding_tokens_total{tenant}    per tenant
    kvseal:embedding_queued_inputs                  inputs waiting in the embed worker's fair queue (last heartbeat)
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class EmbedMetrics:
    def __init__(self, registry: CollectorRegistry, queued: Callable[[], int]) -> None:
        r = registry
        self.requests = Counter("kvseal:embedding_requests", "Embedding requests answered", registry=r)
        self.inputs = Counter("kvseal:embedding_inputs", "Inputs embedded", registry=r)
        self.tokens = Counter("kvseal:embedding_tokens", "Tokens of the inputs embedded", registry=r)
        self.latency = Histogram("kvseal:embedding_request_latency_seconds", "Arrival to answer of embedding "
                                 "requests answered", buckets=LATENCY_BUCKETS, registry=r)
        self.tenant_tokens = Counter("kvseal:tenant_embedding_tokens", "Tokens embedded per tenant", ["tenant"],
                                     registry=r)
        Gauge("kvseal:embedding_queued_inputs", "Inputs waiting in the embed worker's fair queue (as of its last "
              "heartbeat)", registry=r).set_function(queued)

    def observe(self, tenant: str, inputs: int, tokens: int, seconds: float) -> None:
        self.requests.inc()
        self.inputs.inc(inputs)
        self.tokens.inc(tokens)
        self.latency.observe(seconds)
        self.tenant_tokens.labels(tenant).inc(tokens)

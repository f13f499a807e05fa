"""The router's metrics, on its own HTTP port at /metrics (with --api-keys: admin keys only).

    kvseal:time_to_first_token_seconds, kvseal:inter_token_latency_seconds, kvseal:e2e_request_latency_seconds
                                                 histograms, as vLLM's (measured at the router, per request)
    kvseal:prompt_tokens_total, kvseal:generation_tokens_total     of requests that finished
    kvseal:request_success_total{finished_reason}                  stop | length
    kvseal:request_errors_total{status,code}    every response that did not complete: refusals by reason
                                                 (400 context_length_exceeded, 401, 404, 413, 503 overloaded,
                                                 502 kv_verification_failed, ...), streams ended by an error
    kvseal:router_requests_running / _waiting   streaming / not yet given a first token
    kvseal:workers{role,standing}, kvseal:workers_in_rotation{role}, kvseal:fleet_check_refusals_total{role}
    kvseal:tenant_*{tenant}                     per tenant: tokens, TTFT, 429s, in flight, weight (metrics/tenants.py)
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import AsyncGenerator, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Receive, Scope, Send

from kvseal.metrics.tenants import LimitsCollector, TenantCounters
from kvseal.model.tokenizer import Tokenizer
from kvseal.router.backend import Backend
from kvseal.router.membership import Standing
from kvseal.tenancy.requestlog import trace_of
from kvseal.tenancy.tenantview import require_admin
from kvseal.wire.messages import GenerateDelta, GenerateRequest

# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


class FleetCollector(Collector):
    """The router's view of its workers, read at scrape time (a backend without workers yields nothing)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def collect(self) -> Iterator[Any]:
        pools = {"prefill": getattr(self.backend, "prefills", None), "decode": getattr(self.backend, "decodes", None)}
        if pools["prefill"] is None:
            return
        workers = GaugeMetricFamily("kvseal:workers", "Workers by standing in the fleet", labels=["role", "standing"])
        rotation = GaugeMetricFamily("kvseal:workers_in_rotation", "Workers getting requests (SERVING)",
                                     labels=["role"])
        refusals = CounterMetricFamily("kvseal:fleet_check_refusals", "Times a worker failed the fleet check "
                                       "(seal 7) on connecting, reconnecting or joining", labels=["role"])
        for role, pool in pools.items():
            standings = Tally(w.member.standing for w in pool or [])
            for s in Standing:
                workers.add_metric([role, s.value], standings[s])
            rotation.add_metric([role], standings[Standing.SERVING])
            refusals.add_metric([role], sum(w.member.refusals for w in pool or []))
        yield workers
        yield rotation
        yield refusals


class RouterMetrics:
    def __init__(self, backend: Backend) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("kvseal:time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("kvseal:inter_token_latency_seconds", "Time between output tokens", buckets=ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram("kvseal:e2e_request_latency_seconds", "Arrival to last token of finished requests",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvseal:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kvseal:generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.success = Counter("kvseal:request_success", "Finished requests by finish reason", ["finished_reason"],
                               registry=r)
        self.errors = Counter("kvseal:request_errors", "Requests that did not complete, by HTTP status and error code",
                              ["status", "code"], registry=r)
        self.running = Gauge("kvseal:router_requests_running", "Requests streaming output", registry=r)
        self.waiting = Gauge("kvseal:router_requests_waiting", "Requests not yet given their first token", registry=r)
        r.register(FleetCollector(backend))
        self.tenants = TenantCounters(r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MeteredBackend:
    """A Backend that observes every request's deltas for the histograms; everything else is the inner one's."""

    def __init__(self, inner: Backend, metrics: RouterMetrics) -> None:
        self.inner, self.metrics = inner, metrics
        self.tokenizer: Tokenizer = inner.tokenizer
        self.model_name, self.context_window = inner.model_name, inner.context_window

    async def start(self) -> None:
        await self.inner.start()
        # a fleet knows its model name and window once it started
        self.model_name, self.context_window = self.inner.model_name, self.inner.context_window

    async def stop(self) -> None:
        await self.inner.stop()

    async def info(self) -> dict[str, Any]:
        return await self.inner.info()

    async def healthy(self) -> bool:
        return await self.inner.healthy()

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        m = self.metrics
        t0 = last = time.monotonic()
        gauge = m.waiting
        gauge.inc()
        gen = self.inner.generate(req)
        try:
            async for d in gen:
                now = time.monotonic()
                if d.error is None and d.token_ids:
                    m.tenants.generation_tokens.labels(req.tenant).inc(len(d.token_ids))
                    if gauge is m.waiting:
                        m.ttft.observe(now - t0)
                        m.tenants.ttft.labels(req.tenant).observe(now - t0)
                        m.tenants.prompt_tokens.labels(req.tenant).inc(d.prompt_tokens)
                        gauge.dec()
                        gauge = m.running
                        gauge.inc()
                        n = len(d.token_ids) - 1  # the first token's time is the TTFT
                    else:
                        n = len(d.token_ids)
                    for _ in range(n):
                        m.itl.observe((now - last) / n)
                    last = now
                if d.final is not None and d.error is None:
                    m.success.labels(d.final).inc()
                    m.e2e.observe(now - t0)
                    m.prompt_tokens.inc(d.prompt_tokens)
                    m.generation_tokens.inc(d.completion_tokens)
                yield d
        finally:
            gauge.dec()
            await gen.aclose()


class HttpOutcomes:
    """ASGI middleware (outside RequestLog): counts every response that did not complete by status and code, read
    from the request's Trace once the response is out."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)
        if scope["type"] != "http" or scope.get("path") == "/metrics":
            return
        trace = trace_of(scope)
        if trace.status not in (0, 200) or trace.stream_error:
            self.metrics.errors.labels(str(trace.status), trace.code or "-").inc()


def install(app: FastAPI, metrics: RouterMetrics) -> None:
    """GET /metrics (admin keys only: it shows every tenant's load and the fleet) and the outcome counter on an
    app built by router.api.build_app."""
    app.add_middleware(HttpOutcomes, metrics=metrics)
    metrics.registry.register(LimitsCollector(app.state.limits, app.state.tenant_policies))  # set by build_app

    async def exposition(request: Request) -> Response:
        require_admin(request, "/metrics")
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route("/metrics", exposition, methods=["GET"], include_in_schema=False)

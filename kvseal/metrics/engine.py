"""A worker's metrics: its engine's figures read at scrape time (no cost on the step), plus the two histograms the
worker observes as things happen (queue time, KV transfer time). Served on the worker's --metrics-port: the
per-tenant families (the only ones that name a tenant) only to a scrape with the metrics token (metrics/token.py).

    kvseal:num_requests_running / _waiting      gauges (vLLM's meaning; decode counts its reservation queue too)
    kvseal:kv_cache_usage_perc                  1 - free pages / pool pages (0..1)
    kvseal:request_queue_time_seconds           arrival to first scheduled (prefill and unified engines)
    kvseal:pages_scrubbed_total                 pages zeroed before reuse (seal 6)
    kvseal:ownership_check_failures_total       page tables refused before a forward pass (seal 5)
    kvseal:kv_verification_failures_total{field}  handoffs refused by decode, by the manifest field (seal 4)
    kvseal:kv_transfer_bytes_total{direction}   sent (prefill) / received (decode)
    kvseal:kv_transfers_total{result}           acked / refused
    kvseal:kv_transfer_seconds                  prefill: sending a handoff to decode's acknowledgement
    kvseal:tenant_{prefill,decode}_tokens_total{tenant}, _queue_seconds_total, _scheduled_requests_total,
    kvseal:tenant_virtual_tokens, _kv_pages, _requests_running, _requests_waiting   per tenant (engine/fairness.py;
                                                TenantCollector: the metrics token only, or admin keys under
                                                `serve --unified`)
    kvseal:spec_decode_num_draft_tokens_total, _num_accepted_tokens_total, _num_drafts_total, _acceptance_rate
                                                speculative decoding, this engine's requests together (never per
                                                tenant)
    kvseal:prefix_cache_hit_tokens_total, kvseal:cached_pages, kvseal:frames_refused_total, kvseal:worker_info
    kvseal:kv_reads_in_flight, _reads_overdue, _read_pages_overdue, _quarantined_pages   gauges (decode, NIXL):
                                                reads whose pages are claimed, those past their deadline and their
                                                pages, pages of ended requests kept out of the pool until their
                                                read is over
    kvseal:kv_export_pages_held, _export_pages_overdue, _offers_waiting   gauges (prefill, NIXL): export window
                                                pages holding offered KV until decode answers, those whose answer
                                                is past due, offers waiting for room
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from kvseal.metrics.token import gated, serve_wsgi
from kvseal.wire.kvspec import KVSpec

QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)


KV_FIGURES = {  # Transport.figures() (and decode's quarantine) exported as gauges
    "kv_reads_in_flight": "NIXL reads whose claimed pages may still receive bytes",
    "kv_reads_overdue": "NIXL reads past their deadline and still running (their requests ended)",
    "kv_read_pages_overdue": "Pages claimed by NIXL reads past their deadline, out of the pool until the read ends",
    "kv_quarantined_pages": "Pages of ended requests kept out of the pool until their NIXL read is over",
    "kv_export_pages_held": "Export window pages holding offered KV until decode answers",
    "kv_export_pages_overdue": "Export window pages whose decode answer is past the transfer timeout",
    "kv_offers_waiting": "NIXL offers waiting for room in their decode worker's export window",
}


class Engine(Protocol):  # the questions asked of engine/engine.py's Engine (this module imports no engine)
    def info(self) -> dict[str, Any]: ...

    def figures(self) -> dict[str, Any]: ...

    def on_first_scheduled(self, observe: Callable[[float], None]) -> None: ...


class EngineCollector(Collector):
    """Reads `engine` (and the worker's `counters`, `queued()`, `verification_failures`) at each scrape.
    Invariant: no family it yields names a tenant (any scrape of a worker's port sees them)."""

    def __init__(self, engine: Engine, counters: dict[str, int] | None = None,
                 verification_failures: dict[str, int] | None = None, queued: Callable[[], int] = lambda: 0,
                 labels: dict[str, str] | None = None,
                 kv_figures: Callable[[], dict[str, int]] = dict) -> None:
        self.engine = engine
        self.kv_figures = kv_figures
        self.counters = counters if counters is not None else {}
        self.verification_failures = verification_failures if verification_failures is not None else {}
        self.queued = queued
        info = engine.info()  # what the fleet check compares, as labels of kvseal:worker_info
        self.pool_pages = int(info["pool_pages"])
        self.identity = {"role": info["role"], **{k: str(info[k]) for k in KVSpec.__struct_fields__},
                         "kernels": info["kernels"], "arithmetic": info["arithmetic"], **(labels or {})}

    def collect(self) -> Iterator[Any]:
        f, c = self.engine.figures(), self.counters
        yield GaugeMetricFamily("kvseal:num_requests_running", "Requests in the engine's batch", value=f["running"])
        yield GaugeMetricFamily("kvseal:num_requests_waiting", "Requests waiting for pages or compute",
                                value=f["waiting"] + self.queued())
        yield GaugeMetricFamily("kvseal:kv_cache_usage_perc", "KV cache usage (1 = every page held)",
                                value=1.0 - f["free_pages"] / self.pool_pages)
        yield GaugeMetricFamily("kvseal:cached_pages", "Pages held by the prefix cache", value=f["cached_pages"])
        yield CounterMetricFamily("kvseal:prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  value=f["prefix_cache_hit_tokens"])
        yield CounterMetricFamily("kvseal:pages_scrubbed", "KV pages zeroed before reuse (seal 6)",
                                  value=f["pages_scrubbed"])
        yield CounterMetricFamily("kvseal:ownership_check_failures", "Page tables refused before a forward pass "
                                  "(seal 5)", value=f["ownership_violations"])
        failures = CounterMetricFamily("kvseal:kv_verification_failures", "KV handoffs refused by decode, by the "
                                       "manifest field that failed (seal 4)", labels=["field"])
        for field, n in sorted(self.verification_failures.items()):
            failures.add_metric([field], n)
        yield failures
        moved = CounterMetricFamily("kvseal:kv_transfer_bytes", "KV bytes moved between workers",
                                    labels=["direction"])
        moved.add_metric(["sent"], c.get("kv_bytes_sent", 0))
        moved.add_metric(["received"], c.get("kv_bytes_received", 0))
        yield moved
        transfers = CounterMetricFamily("kvseal:kv_transfers", "KV handoffs by result", labels=["result"])
        transfers.add_metric(["acked"], c.get("transfers_acked", 0))
        transfers.add_metric(["refused"], c.get("transfers_refused", 0))
        yield transfers
        drafted, accepted = f.get("spec_drafted_tokens", 0), f.get("spec_accepted_tokens", 0)
        yield CounterMetricFamily("kvseal:spec_decode_num_draft_tokens", "Draft tokens verified (speculative "
                                  "decoding by prompt lookup), this engine's requests together", value=drafted)
        yield CounterMetricFamily("kvseal:spec_decode_num_accepted_tokens", "Of them, the tokens accepted",
                                  value=accepted)
        yield CounterMetricFamily("kvseal:spec_decode_num_drafts", "Requests' steps that verified a draft",
                                  value=f.get("spec_drafts", 0))
        yield GaugeMetricFamily("kvseal:spec_decode_acceptance_rate", "Accepted over drafted tokens since start "
                                "(0 before any draft)", value=accepted / drafted if drafted else 0.0)
        yield CounterMetricFamily("kvseal:frames_refused", "Malformed or refused frames from peers",
                                  value=c.get("frames_refused", 0))
        yield CounterMetricFamily("kvseal:requests_received", "Requests this worker received",
                                  value=c.get("requests_received", 0))
        yield CounterMetricFamily("kvseal:steps_on_lent_cores", "Engine steps run with the cores of idle workers "
                                  "on this host beside this worker's own (worker/cores.py)",
                                  value=c.get("steps_on_lent_cores", 0))
        figures = self.kv_figures()
        for key, doc in KV_FIGURES.items():
            if key in figures:
                yield GaugeMetricFamily(f"kvseal:{key}", doc, value=figures[key])
        info = InfoMetricFamily("kvseal:worker", "What this worker is (the fleet check compares these)")
        info.add_metric([], self.identity)
        yield info


TENANT_FIGURES = (  # engine/fairness.FairShare.figures(): (key, metric, kind, help)
    ("prefill_tokens", "kvseal:tenant_prefill_tokens", "counter", ("Prompt (and recomputed) tokens this engine fed "
     "for a tenant")),
    ("decode_tokens", "kvseal:tenant_decode_tokens", "counter", "Output tokens this engine fed for a tenant"),
    ("queue_seconds", "kvseal:tenant_queue_seconds", "counter", ("Arrival to first scheduled, summed over a tenant's "
     "requests")),
    ("scheduled", "kvseal:tenant_scheduled_requests", "counter", "A tenant's requests first scheduled"),
    ("vtc", "kvseal:tenant_virtual_tokens", "gauge", ("A tenant's virtual token counter (weighted tokens served over "
     "its weight; the lowest is admitted next)")),
    ("kv_pages", "kvseal:tenant_kv_pages", "gauge", "KV pages a tenant's requests hold now"),
    ("running", "kvseal:tenant_requests_running", "gauge", "A tenant's requests in the batch"),
    ("waiting", "kvseal:tenant_requests_waiting", "gauge", "A tenant's requests waiting to be scheduled"),
)


def tenant_families(e: Engine) -> Iterator[Any]:
    """Per tenant: what this engine served it and holds for it (labels: tenant)."""
    figures: dict[str, dict[str, float]] = e.figures()["tenants"]
    for key, name, kind, doc in TENANT_FIGURES:
        fam: CounterMetricFamily | GaugeMetricFamily = (
            CounterMetricFamily(name, doc, labels=["tenant"]) if kind == "counter" else
            GaugeMetricFamily(name, doc, labels=["tenant"]))
        for tenant, f in figures.items():
            fam.add_metric([tenant], f[key])
        yield fam


class TenantCollector(Collector):
    """Every tenant's figures in `engine`: they name tenants, so they go only where tenants' names may go."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        yield from tenant_families(self.engine)


class WorkerMetrics:
    """One process's metrics: `registry`, what any scrape sees (the engine collector and the histograms the worker
    observes; no tenant name), and `tenant_registry`, the same and every tenant's figures."""

    def __init__(self, collector: EngineCollector, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(collector)
        self.queue_time = Histogram("kvseal:request_queue_time_seconds", "Arrival to first scheduled",
                                    buckets=QUEUE_BUCKETS, registry=self.registry)
        self.transfer_seconds = Histogram("kvseal:kv_transfer_seconds", "A KV handoff, sent to acknowledged",
                                          buckets=TRANSFER_BUCKETS, registry=self.registry)
        collector.engine.on_first_scheduled(self.queue_time.observe)
        self.tenant_registry = CollectorRegistry()
        for c in (collector, self.queue_time, self.transfer_seconds, TenantCollector(collector.engine)):
            self.tenant_registry.register(c)
        self.endpoint: str | None = None

    def serve(self, host: str, port: int, token_sha256: str | None = None) -> str:
        """Serve /metrics over HTTP on host:port (0: any free port); returns the URL. `tenant_registry` goes only to
        a scrape with the metrics token whose digest is `token_sha256` (None: to nobody), `registry` to the rest."""
        app = gated(make_wsgi_app(self.registry), make_wsgi_app(self.tenant_registry), token_sha256)
        server = serve_wsgi(host, port, app)
        self.endpoint = f"http://{host}:{server.server_port}/metrics"
        return self.endpoint

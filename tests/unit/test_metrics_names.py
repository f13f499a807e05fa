"""docs/grafana-kvseal.json queries only metrics kvseal exports, and every family carries the `kvseal:` prefix."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from kvseal.metrics.engine import EngineCollector, WorkerMetrics
from kvseal.metrics.router import RouterMetrics
from kvseal.model.checkpoint import Checkpoint
from kvseal.router.membership import Membership, Standing

from .conftest import make_engine

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-kvseal.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",), "info": ("_info",)}


def exported(registry: CollectorRegistry) -> set[str]:
    names = set()
    for fam in registry.collect():
        assert fam.name.startswith("kvseal:"), fam.name
        names |= {fam.name + s for s in _SUFFIXES[fam.type]}
    return names


def test_the_dashboard_queries_only_exported_metrics(tiny: Checkpoint) -> None:
    refused = SimpleNamespace(member=Membership("decode x"))
    refused.member.move(Standing.CHECKING)
    refused.member.move(Standing.REFUSED, "page_size=32")
    backend = SimpleNamespace(prefills=[], decodes=[refused])
    router = RouterMetrics(backend)  # type: ignore[arg-type]
    worker = WorkerMetrics(EngineCollector(make_engine(tiny), labels={"endpoint": "tcp://x"}))
    names = exported(router.registry) | exported(worker.tenant_registry)  # the token's view: every family
    text = router.exposition().decode()
    assert 'kvseal:fleet_check_refusals_total{role="decode"} 1.0' in text
    assert 'kvseal:workers{role="decode",standing="refused"} 1.0' in text
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dash["templating"]["list"]]
    used = {m for e in exprs for m in re.findall(r"kvseal:[a-z0-9_]+", e)}
    assert len(used) >= 20 and used <= names, used - names


def test_what_the_kv_transport_holds_is_exported(tiny: Checkpoint) -> None:
    """The NIXL figures of /info (reads past their deadline, the pages they keep, export window pages) as gauges."""
    figures = {"kv_reads_in_flight": 2, "kv_reads_overdue": 1, "kv_read_pages_overdue": 3, "kv_quarantined_pages": 3,
               "kv_export_pages_held": 5, "kv_export_pages_overdue": 4, "kv_offers_waiting": 1}
    worker = WorkerMetrics(EngineCollector(make_engine(tiny), kv_figures=lambda: figures))
    samples = {s.name: s.value for fam in worker.registry.collect() for s in fam.samples}
    assert {f"kvseal:{k}": float(v) for k, v in figures.items()}.items() <= samples.items()

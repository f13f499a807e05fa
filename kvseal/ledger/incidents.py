"""`kvseal incidents PATH`: from a forensic ledger, the responses that could have been computed from KV not written
for them, the tenants affected, and where that KV came from (another request's prompt or generated tokens,
nothing written at all, or bytes a handoff carried that its manifest did not claim).

Exit 0: none found; 1: some found; 2: the ledger cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

_SOURCES = {"prompt": "another request's prompt", "generated": "another request's generated tokens",
            "unwritten": "nothing written for it (scrubbed or never used)",
            "transfer": "handoff bytes its manifest did not claim"}


@dataclass
class Incident:
    request_id: str
    tenant: str
    role: str
    worker: str
    ended: float
    state: str
    foreign_tokens: int
    prefill_worker: str | None = None
    decode_worker: str | None = None
    # kind -> tokens, and (source request, source tenant, kind) -> tokens
    by_kind: dict[str, int] = field(default_factory=dict)
    sources: list[tuple[str, str, str, int]] = field(default_factory=list)


def parse_time(text: str) -> float:
    """Unix seconds, or an ISO 8601 date/time (UTC when no zone is given)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time: {text!r} (give unix seconds or ISO 8601, e.g. "
                                         f"2026-09-09T12:00:00Z)") from None
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


def find(path: str, since: float | None = None, until: float | None = None) -> tuple[int, list[Incident]]:
    """(rows in the window, incidents). Raises sqlite3.Error / FileNotFoundError when it cannot read."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no ledger at {path}")
    db = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True, timeout=30.0)
    try:
        lo, hi = since if since is not None else 0.0, until if until is not None else 1e18
        (total,) = db.execute("SELECT count(*) FROM requests WHERE ended >= ? AND ended <= ?", (lo, hi)).fetchone()
        rows = db.execute("SELECT request_id, tenant, role, worker, ended, state, foreign_tokens, foreign_reads "
                          "FROM requests WHERE foreign_tokens > 0 AND ended >= ? AND ended <= ? ORDER BY ended",
                          (lo, hi)).fetchall()
        out: list[Incident] = []
        for rid, tenant, role, worker, ended, state, n, reads in rows:
            inc = Incident(rid, tenant, role, worker, ended, state, n)
            kinds: Counter[str] = Counter()
            sources: Counter[tuple[str, str, str]] = Counter()
            for _page, a, b, src, src_tenant, kind in json.loads(reads):
                kinds[kind] += b - a
                sources[(src, src_tenant, kind)] += b - a
            inc.by_kind = dict(kinds)
            inc.sources = [(s, t, k, c) for (s, t, k), c in sorted(sources.items())]
            route = db.execute("SELECT prefill_worker, decode_worker FROM requests WHERE request_id = ? AND "
                               "role = 'router' LIMIT 1", (rid,)).fetchone()
            if route is not None:
                inc.prefill_worker, inc.decode_worker = route
            out.append(inc)
        return int(total), out
    finally:
        db.close()


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def report(path: str, total: int, found: list[Incident]) -> str:
    lines = [f"ledger {path}: {total:,} request record(s) in the window"]
    if not found:
        lines.append("no response read KV that was not written for it")
        return "\n".join(lines)
    lines.append(f"{len(found)} response(s) could have been computed from KV not written for them:")
    w = max(len(i.request_id) for i in found)
    lines.append(f"  {'request':<{w}} {'tenant':<12} {'ended':<20} {'state':<9} {'worker':<32} foreign tokens")
    for i in found:
        lines.append(f"  {i.request_id:<{w}} {i.tenant or '-':<12} {_when(i.ended):<20} {i.state:<9} "
                     f"{i.role + ' ' + i.worker:<32} {i.foreign_tokens:,} ("
                     + ", ".join(f"{k} {v:,}" for k, v in sorted(i.by_kind.items())) + ")")
    readers = Counter(i.tenant or "-" for i in found)
    lines.append("tenants affected (their responses): " + ", ".join(f"{t} ({n})" for t, n in readers.most_common()))
    owners: dict[str, Counter[str]] = defaultdict(Counter)
    for i in found:
        for src, src_tenant, kind, n in i.sources:
            if kind in ("prompt", "generated"):
                owners[src_tenant or "-"][kind] += n
    if owners:
        lines.append("tenants whose KV was read by others: " + "; ".join(
            f"{t}: " + ", ".join(f"{_SOURCES[k]} {n:,} tokens" for k, n in sorted(c.items()))
            for t, c in sorted(owners.items())))
    kinds: Counter[str] = Counter()
    for i in found:
        kinds.update(i.by_kind)
    lines.append("where the foreign KV came from: " + "; ".join(f"{_SOURCES.get(k, k)}: {n:,} tokens"
                                                               for k, n in kinds.most_common()))
    return "\n".join(lines)


def add_incidents_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="the ledger file (kvseal serve --ledger)")
    p.add_argument("--since", type=parse_time, default=None, help="only requests that ended at or after T "
                   "(unix seconds or ISO 8601)")
    p.add_argument("--until", type=parse_time, default=None, help="only requests that ended at or before T")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run_incidents(a: argparse.Namespace) -> int:
    try:
        total, found = find(a.path, a.since, a.until)
    except (OSError, sqlite3.Error) as exc:
        print(f"kvseal incidents: cannot read the ledger {a.path}: {exc}", file=sys.stderr)
        return 2
    if a.json:
        doc: dict[str, Any] = {"ledger": a.path, "records": total, "checked_at": time.time(),
                               "incidents": [asdict(i) for i in found],
                               "tenants_affected": sorted({i.tenant for i in found})}
        print(json.dumps(doc, indent=1))
    else:
        print(report(a.path, total, found))
    return 1 if found else 0

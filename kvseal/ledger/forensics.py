"""The engine's side of the forensic ledger: which KV each request read, and whose it was.

After every step the engine reports what each sequence computed (`after_step`): its positions start..end-1 were
written by it (prompt or generated tokens, `kv/provenance.py`), and it read positions 0..end-1. Positions it did
not write itself are looked up once per incarnation (a preemption starts over): a cached page of its own
namespace is a cache read (seal 9, legitimate), anything else is a foreign read with its source (request, tenant,
prompt or generated tokens, or nothing written: zeros or bytes nobody claimed). In normal operation that lookup
covers only prefix-cache hits and a handoff's pages, so the per-step cost is a few tuple operations per sequence.

A decode worker reports each handoff (`transferred`): the manifest's tokens were written for the request; the rest
of the pages that came is unclaimed. When a request ends (`row`) its record goes to the ledger; it holds ids, page
ids, owners and sources, never text.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Pages
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvseal.kv.allocator import CACHED, FREE, Owner, PageAllocator
from kvseal.kv.provenance import PageProvenance, Writer
from kvseal.ledger.store import Ledger, LedgerRow
from kvseal.transfer.manifest import KVManifest, PagePayload, PoolPages, page_checksums

_UNCLAIMED = Writer("", "", 0, "transfer")


class Sequence(Protocol):
    """What the ledger reads of a request (engine/sequence.py): whose it is, its pages and how far it computed."""

    request_id: str
    tenant: str
    cache_ns: int
    owner: Owner
    prompt_ids: list[int]
    pages: list[int]
    num_computed: int


@dataclass
class ReadLog:
    received: float = field(default_factory=time.time)
    epoch: int = -1  # the owner epoch these reads belong to: a preemption (new epoch) starts them over
    checked: int = 0  # positions 0..checked-1 of this incarnation are accounted for
    seen_pages: int = 0
    reservation_id: str | None = None
    verification: dict[str, Any] | None = None
    pages: list[tuple[int, str, int]] = field(default_factory=list)
    cached: list[tuple[int, str, str]] = field(default_factory=list)
    foreign: list[tuple[int, int, int, str, str, str]] = field(default_factory=list)


class Forensics:
    def __init__(self, ledger: Ledger, allocator: PageAllocator, page_size: int, role: str) -> None:
        self.ledger, self.allocator, self.role = ledger, allocator, role
        self.page_size = page_size
        self.worker = role  # the worker server names its endpoint here
        self.prov = PageProvenance(allocator.num_pages, page_size)
        self.logs: dict[str, ReadLog] = {}

    def log_of(self, seq: Sequence) -> ReadLog:
        log = self.logs.get(seq.request_id)
        if log is None:
            log = self.logs[seq.request_id] = ReadLog()
        return log

    def scrubbed(self, pages: Pages[int]) -> None:
        self.prov.scrubbed(pages)

    def transferred(self, seq: Sequence, pages: list[int], num_tokens: int) -> None:
        """A handoff's pages were written into `pages`: the manifest's num_tokens are the request's prompt KV,
        the remaining slots of those pages hold bytes nobody claimed."""
        ps = self.page_size
        w = Writer(seq.request_id, seq.tenant, seq.cache_ns, "prompt")
        for i, page in enumerate(pages):
            self.prov.wrote(page, 0, ps, _UNCLAIMED)
            self.prov.wrote(page, 0, max(0, min(ps, num_tokens - i * ps)), w)

    def verified(self, seq: Sequence, result: str, m: KVManifest, payload: PagePayload | PoolPages | None,
                 field: str | None = None) -> None:
        """A handoff's check, page by page: every page matched (ok), was not checked (the incident fault), or, after
        a failure, which pages' checksums differed (when the counts allowed comparing; none when refused before a
        byte moved, an in-place transport's claim)."""
        if payload is None:
            pages: list[str] = []
        elif result == "failed":
            same = len(m.page_checksums) == payload.num_pages and payload.num_pages > 0 and payload.nbytes > 0
            got = payload.checksums() if isinstance(payload, PoolPages) else page_checksums(payload) if same else []
            pages = ["ok" if a == b else "mismatch" for a, b in zip(m.page_checksums, got)] if same else []
        else:
            pages = [result] * payload.num_pages
        self.log_of(seq).verification = {"result": result, "field": field, "pages": pages}

    def after_step(self, seq: Sequence, n: int) -> None:
        """seq computed positions num_computed-n..num_computed-1 this step and read 0..num_computed-1."""
        log = self.log_of(seq)
        if log.epoch != seq.owner.epoch:
            log.epoch, log.checked, log.seen_pages = seq.owner.epoch, 0, 0
        end = seq.num_computed
        start, plen = end - n, len(seq.prompt_ids)
        if start < plen:
            self.prov.wrote_positions(seq.pages, start, min(end, plen),
                                      Writer(seq.request_id, seq.tenant, seq.cache_ns, "prompt"))
        if end > plen:
            self.prov.wrote_positions(seq.pages, max(start, plen), end,
                                      Writer(seq.request_id, seq.tenant, seq.cache_ns, "generated"))
        if log.checked < start:
            self._check(seq, log, log.checked, start)
        log.checked = end
        npages = -(-end // self.page_size)
        if npages > log.seen_pages:
            for page in seq.pages[log.seen_pages:npages]:
                key, epoch = self.allocator.owner_of(page)
                who = seq.request_id if key == seq.owner.key else ("cached" if key == CACHED else
                                                                    "free" if key == FREE else f"key:{key}")
                log.pages.append((page, who, epoch))
            log.seen_pages = npages

    def _check(self, seq: Sequence, log: ReadLog, lo: int, hi: int) -> None:
        cached_seen = {p for p, _, _ in log.cached}
        for page, seg in self.prov.not_written_by(seq.pages, lo, hi, seq.request_id):
            w = seg.writer
            if w is not None and w.kind == "prompt" and w.namespace == seq.cache_ns and self.allocator.cached([page]):
                if page not in cached_seen:  # seal 9: a shared page of its own tenant and cache_salt
                    cached_seen.add(page)
                    log.cached.append((page, f"{seq.cache_ns & (2**64 - 1):016x}", w.request_id))
                continue
            log.foreign.append((page, seg.lo, seg.hi, w.request_id if w else "", w.tenant if w else "",
                                w.kind if w else "unwritten"))

    def row(self, seq: Sequence, state: str, error_code: str | None, drafted: int = 0, accepted: int = 0) -> None:
        """seq ended here (or, on prefill, was handed off): write its record (with its speculative decoding's draft
        tokens verified and accepted)."""
        log = self.logs.pop(seq.request_id, None) or ReadLog()
        self.ledger.add(LedgerRow(
            request_id=seq.request_id, role=self.role, worker=self.worker, tenant=seq.tenant,
            received=log.received, ended=time.time(), state=state, error_code=error_code,
            reservation_id=log.reservation_id, pages=log.pages, verification=log.verification, cached=log.cached,
            foreign_reads=log.foreign, drafted=drafted, accepted=accepted))

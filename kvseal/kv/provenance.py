"""Who wrote what is in each KV page: the forensic ledger's view of the pool. No torch, no KV bytes.

Per page, a list of segments (lo, hi, writer) over the page's slots 0..page_size-1: the slots lo..hi-1 hold KV that
`writer` computed (or received) for itself. A scrub (seal 6) empties the list; a page that is freed without a scrub
keeps it, so a later reader of slots it did not write itself is seen to read someone else's KV.

Invariants: segments of a page are sorted, disjoint and within [0, page_size); a slot absent from every segment
holds nothing anyone wrote since the last scrub (zeros, or never written).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple


class Writer(NamedTuple):
    request_id: str  # "" for bytes of unknown origin (a peer sent them but its manifest did not claim them)
    tenant: str
    namespace: int  # the writer's prefix-cache namespace (tenant, cache_salt)
    kind: str  # "prompt" | "generated" | "transfer" (unclaimed bytes that came in a KV handoff)


class Segment(NamedTuple):
    lo: int
    hi: int
    writer: Writer | None  # None: nothing written since the last scrub


class PageProvenance:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self._segs: list[list[Segment]] = [[] for _ in range(num_pages)]

    def wrote(self, page: int, lo: int, hi: int, writer: Writer) -> None:
        """Slots lo..hi-1 of `page` now hold `writer`'s KV."""
        if lo >= hi:
            return
        out = [s for s in self._segs[page] if s.hi <= lo or s.lo >= hi]
        out += [Segment(s.lo, lo, s.writer) for s in self._segs[page] if s.lo < lo < s.hi]
        out += [Segment(hi, s.hi, s.writer) for s in self._segs[page] if s.lo < hi < s.hi]
        out.append(Segment(lo, hi, writer))
        out.sort()
        merged: list[Segment] = []
        for s in out:  # a decode step extends its last segment by one slot: keep the list short
            if merged and merged[-1].hi == s.lo and merged[-1].writer == s.writer:
                merged[-1] = Segment(merged[-1].lo, s.hi, s.writer)
            else:
                merged.append(s)
        self._segs[page] = merged

    def wrote_positions(self, table: Sequence[int], start: int, end: int, writer: Writer) -> None:
        """Positions start..end-1 of a sequence whose page table is `table` now hold `writer`'s KV."""
        ps = self.page_size
        pos = start
        while pos < end:
            page_end = min((pos // ps + 1) * ps, end)
            self.wrote(table[pos // ps], pos % ps, page_end - pos + pos % ps, writer)
            pos = page_end

    def scrubbed(self, pages: Sequence[int]) -> None:
        for p in pages:
            self._segs[p] = []

    def not_written_by(self, table: Sequence[int], start: int, end: int,
                       request_id: str) -> Iterator[tuple[int, Segment]]:
        """(page, segment) for every run of positions start..end-1 whose KV `request_id` did not write itself:
        another writer's, or nobody's (writer None). Segment bounds are slots within the page."""
        ps = self.page_size
        pos = start
        while pos < end:
            page = table[pos // ps]
            lo, hi = pos % ps, min((pos // ps + 1) * ps, end) - (pos // ps) * ps
            cursor = lo
            for s in self._segs[page]:
                if s.hi <= cursor or s.lo >= hi:
                    continue
                if s.lo > cursor:
                    yield page, Segment(cursor, s.lo, None)
                a, b = max(s.lo, cursor), min(s.hi, hi)
                if s.writer is None or s.writer.request_id != request_id:
                    yield page, Segment(a, b, s.writer)
                cursor = b
            if cursor < hi:
                yield page, Segment(cursor, hi, None)
            pos = (pos // ps + 1) * ps

"""Batch -> tensors -> forward -> logits. The ownership check of seal 5 happens here, before the forward.

For each scheduled sequence the runner feeds tokens [num_computed, num_computed + n) and writes their KV
into the sequence's own pages. A sequence whose page table is not owned by it (owner key and epoch, in the
allocator's owner array) is dropped from the batch before any KV is read, and reported back as violating.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvseal.engine.scheduler import Batch
from kvseal.engine.sequence import Sequence
from kvseal.kv.allocator import PageAllocator, pages_for
from kvseal.kv.pool import KVPool
from kvseal.kv.window import WindowPages
from kvseal.model.attention import AttentionMeta, PrefillSpan
from kvseal.model.llama import LlamaModel


@dataclass
class StepResult:
    sampled: list[Sequence]  # sequences whose next token is due, in logits row order
    logits: torch.Tensor | None  # (sum(rows), V) float32: 1 + len(draft) rows for each sampled sequence, in order
    violations: list[Sequence]  # failed the ownership check; nothing was computed for them
    rows: list[int] = field(default_factory=list)  # per sampled sequence: its logits rows (1 + its draft)


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, allocator: PageAllocator,
                 window: WindowPages | None = None) -> None:
        """window: the sliding layers' own pool and allocator (kv/window.py); None: every layer is in `pool`."""
        self.model, self.pool, self.allocator, self.window = model, pool, allocator, window
        self.device = pool.k.device
        # per model layer, the cache it reads: one pool's layer, or either pool's when the window is split off
        self.k_layers: torch.Tensor | list[torch.Tensor] = pool.k
        self.v_layers: torch.Tensor | list[torch.Tensor] = pool.v
        if window is not None:
            self.k_layers, self.v_layers = window.layer_caches(pool)

    def check_ownership(self, batch: Batch) -> list[Sequence]:
        return [s for s, n in zip(batch.seqs, batch.num_new) if not self._may_run(s, n)]

    def _may_run(self, seq: Sequence, n: int) -> bool:
        """Seal 5: every page in the table is the sequence's own, or a cached page it holds under its own tenant
        key; and the pages this step writes (positions num_computed..+n) are its own: cached pages are read-only."""
        ps = self.pool.page_size
        written = seq.pages[seq.num_computed // ps : pages_for(seq.num_computed + n, ps)]
        return (self.allocator.may_read(seq.owner, seq.cache_ns, seq.pages) and self.allocator.owns(seq.owner, written)
                and (self.window is None or self.window.owns(seq)))

    def run(self, batch: Batch, all_logits: bool = False) -> StepResult:
        """all_logits: logits for every row fed this step, in row order (teacher-forced scoring, benchmarks),
        instead of the rows whose next token is due."""
        violations = self.check_ownership(batch)
        bad = {id(s) for s in violations}
        seqs = [(s, n) for s, n in zip(batch.seqs, batch.num_new) if id(s) not in bad]
        if not seqs:
            return StepResult([], None, violations)
        flat = _flatten(seqs, all_logits)
        # one metadata builder per kernel set: the fast kernels' spans and flat tables, or torch's masks and
        # padded decode tables; the sliding layers read their own tables, from their first kept page
        build = self._spans if self.model.fast else self._meta
        meta = build(seqs, lambda s: (s.pages, 0))
        if self.window is not None:
            meta.window = build(seqs, lambda s: (s.window_pages, s.window_base))
        logits = self.model.forward(
            torch.tensor(flat.ids, dtype=torch.long, device=self.device),
            torch.tensor(flat.positions, dtype=torch.long, device=self.device),
            self.k_layers, self.v_layers, meta,
            torch.tensor(flat.logits_rows, dtype=torch.long, device=self.device),
        )
        for seq, n in seqs:
            seq.num_computed += n
        return StepResult(flat.sampled, logits if flat.sampled or all_logits else None, violations, flat.rows)

    def _rows(self, seqs: list[tuple[Sequence, int]], table_of: Callable[[Sequence], tuple[list[int], int]],
              ) -> tuple[list[int], list[_Rows]]:
        """The slot of every row fed this step, and each sequence's rows against one pool's table. table_of(seq) ->
        (pages, base): pages[j] holds positions (base + j) * S .. + S - 1 (base > 0: the window pool's table, whose
        earlier pages were dropped). Positions are relative to base * S: attention needs nothing else (causal and
        window masks are the same under a shift)."""
        ps = self.pool.page_size
        slots: list[int] = []
        rows: list[_Rows] = []
        row0 = 0
        for seq, n in seqs:
            table, base = table_of(seq)
            start = seq.num_computed - base * ps
            end = start + n
            slots += (table[p // ps] * ps + p % ps for p in range(start, end))
            rows.append(_Rows(row0, n, table[: pages_for(end, ps)], start, end))
            row0 += n
        return slots, rows

    def _meta(self, seqs: list[tuple[Sequence, int]],
              table_of: Callable[[Sequence], tuple[list[int], int]]) -> AttentionMeta:
        """torch attention's metadata for one pool: padded tables and masks for the decode rows, one span (and a
        causal mask for a later chunk) per prefill."""
        ps = self.pool.page_size
        slots, rows = self._rows(seqs, table_of)
        decode = [r for r in rows if r.n == 1]
        prefills: list[PrefillSpan] = []
        for r in rows:
            if r.n == 1:
                continue
            mask = None
            if r.start > 0:  # a later chunk: queries at start..end-1 see keys 0..their own position
                qpos = torch.arange(r.start, r.end)[:, None]
                mask = (torch.arange(r.end)[None, :] <= qpos).to(self.device)
            prefills.append(PrefillSpan(r.row0, r.n, r.end, torch.tensor(r.table, dtype=torch.long).to(self.device),
                                        mask))
        meta = AttentionMeta(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            decode_rows=None, decode_pages=None, decode_mask=None, decode_kv_lens=None, prefills=prefills,
        )
        if decode:
            max_pages = max(len(r.table) for r in decode)
            # pad each row with its own last page: a padded slot is masked out and never another request's
            padded = [r.table + [r.table[-1]] * (max_pages - len(r.table)) for r in decode]
            kv_lens = torch.tensor([r.end for r in decode])
            mask = torch.arange(max_pages * ps)[None, :] < kv_lens[:, None]
            meta.decode_rows = torch.tensor([r.row0 for r in decode], dtype=torch.long, device=self.device)
            meta.decode_pages = torch.tensor(padded, dtype=torch.long, device=self.device)
            meta.decode_mask = mask[:, None, None, :].to(self.device)
            meta.decode_kv_lens = kv_lens.to(self.device)
        return meta

    def _spans(self, seqs: list[tuple[Sequence, int]],
               table_of: Callable[[Sequence], tuple[list[int], int]]) -> AttentionMeta:
        """The fast attention's metadata for one pool: one span per sequence (first row, rows, first position,
        offset in tables, pages) over one flat list of tables."""
        slots, rows = self._rows(seqs, table_of)
        spans: list[int] = []
        tables: list[int] = []
        for r in rows:
            spans += (r.row0, r.n, r.start, len(tables), len(r.table))
            tables += r.table
        return AttentionMeta(slot_mapping=torch.tensor(slots, dtype=torch.long), decode_rows=None,
                             decode_pages=None, decode_mask=None, decode_kv_lens=None, prefills=[],
                             spans=torch.tensor(spans, dtype=torch.long).view(-1, 5),
                             tables=torch.tensor(tables, dtype=torch.long))


@dataclass
class _Rows:
    """One sequence's rows in a step, against one pool's table (positions relative to the table's base)."""

    row0: int  # its first row in the flat batch
    n: int  # rows (tokens fed)
    table: list[int]  # the pages that hold positions 0..end-1 (relative)
    start: int  # the first position fed
    end: int  # one past the last


@dataclass
class _Flat:
    """A step's batch flattened once, whatever the kernels: one row per token fed."""

    ids: list[int]
    positions: list[int]
    logits_rows: list[int]  # the rows whose logits are returned, in order
    sampled: list[Sequence]  # the sequences whose next token is due (all_logits: still only those)
    rows: list[int]  # per sampled sequence, its logits rows: its last token's and one per draft token


def _flatten(seqs: list[tuple[Sequence, int]], all_logits: bool) -> _Flat:
    flat = _Flat([], [], [], [], [])
    for seq, n in seqs:
        start, end = seq.num_computed, seq.num_computed + n
        flat.ids += seq.token_slice(start, end)
        flat.positions += range(start, end)
        if end == seq.num_target:  # the scheduler feeds a draft whole: its rows are the last 1 + len(draft)
            rows = 1 + len(seq.draft)
            flat.logits_rows += range(len(flat.ids) - rows, len(flat.ids))
            flat.sampled.append(seq)
            flat.rows.append(rows)
    if all_logits:
        flat.logits_rows = list(range(len(flat.ids)))
    return flat

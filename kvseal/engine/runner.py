"""Batch -> tensors -> forward -> logits. The ownership check of seal 5 happens here, before the forward.

For each scheduled sequence the runner feeds tokens [num_computed, num_computed + n) and writes their KV
into the sequence's own pages. A sequence whose page table is not owned by it (owner key and epoch, in the
allocator's owner array) is dropped from the batch before any KV is read, and reported back as violating.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
    logits: torch.Tensor | None  # (len(sampled), V) float32
    violations: list[Sequence]  # failed the ownership check; nothing was computed for them


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
        if self.model.fast:
            return self._run_fast(seqs, violations, all_logits)
        ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        for seq, n in seqs:
            start, end = seq.num_computed, seq.num_computed + n
            ids.extend(seq.token_slice(start, end))
            positions.extend(range(start, end))
            if end == seq.num_tokens:
                logits_rows.append(len(ids) - 1)
                sampled.append(seq)
        meta = self._meta(seqs, lambda s: (s.pages, 0))
        if self.window is not None:  # the sliding layers read their own tables, from their first kept page
            meta.window = self._meta(seqs, lambda s: (s.window_pages, s.window_base))
        if all_logits:
            logits_rows = list(range(len(ids)))
        if not logits_rows:
            logits_rows_t = torch.empty(0, dtype=torch.long, device=self.device)
        else:
            logits_rows_t = torch.tensor(logits_rows, dtype=torch.long, device=self.device)
        logits = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.k_layers, self.v_layers, meta, logits_rows_t,
        )
        for seq, n in seqs:
            seq.num_computed += n
        return StepResult(sampled, logits if sampled or all_logits else None, violations)

    def _meta(self, seqs: list[tuple[Sequence, int]],
              table_of: Callable[[Sequence], tuple[list[int], int]]) -> AttentionMeta:
        """Slots and page tables for one pool. table_of(seq) -> (pages, base): pages[j] holds positions
        (base + j) * S .. + S - 1 (base > 0: the window pool's table, whose earlier pages were dropped). Positions
        in the meta are relative to base * S; attention needs nothing else (causal and window masks are the same
        under a shift)."""
        ps = self.pool.page_size
        slots: list[int] = []
        decode: list[tuple[int, list[int], int]] = []  # (row, table, kv_len)
        prefills: list[PrefillSpan] = []
        row0 = 0
        for seq, n in seqs:
            table, base = table_of(seq)
            off = base * ps
            start, end = seq.num_computed - off, seq.num_computed + n - off
            slots.extend(table[p // ps] * ps + p % ps for p in range(start, end))
            if n == 1:
                decode.append((row0, table[: pages_for(end, ps)], end))
            else:
                pages = torch.tensor(table[: pages_for(end, ps)], dtype=torch.long)
                mask = None
                if start > 0:  # a later chunk: queries at start..end-1 see keys 0..their own position
                    qpos = torch.arange(start, end)[:, None]
                    mask = (torch.arange(end)[None, :] <= qpos).to(self.device)
                prefills.append(PrefillSpan(row0, n, end, pages.to(self.device), mask))
            row0 += n
        meta = AttentionMeta(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            decode_rows=None, decode_pages=None, decode_mask=None, decode_kv_lens=None, prefills=prefills,
        )
        if decode:
            max_pages = max(len(t) for _, t, _ in decode)
            # pad each row with its own last page: a padded slot is masked out and never another request's
            padded = [t + [t[-1]] * (max_pages - len(t)) for _, t, _ in decode]
            kv_lens = torch.tensor([kv for _, _, kv in decode])
            mask = torch.arange(max_pages * ps)[None, :] < kv_lens[:, None]
            meta.decode_rows = torch.tensor([r for r, _, _ in decode], dtype=torch.long, device=self.device)
            meta.decode_pages = torch.tensor(padded, dtype=torch.long, device=self.device)
            meta.decode_mask = mask[:, None, None, :].to(self.device)
            meta.decode_kv_lens = kv_lens.to(self.device)
        return meta

    def _run_fast(self, seqs: list[tuple[Sequence, int]], violations: list[Sequence], all_logits: bool) -> StepResult:
        """The fast arithmetic's batch: flat rows plus one span per sequence for the one attention call."""
        ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        for seq, n in seqs:
            start, end = seq.num_computed, seq.num_computed + n
            ids += seq.token_slice(start, end)
            positions += range(start, end)
            if end == seq.num_tokens:
                logits_rows.append(len(ids) - 1)
                sampled.append(seq)
        if all_logits:
            logits_rows = list(range(len(ids)))
        meta = self._spans(seqs, lambda s: (s.pages, 0))
        if self.window is not None:
            meta.window = self._spans(seqs, lambda s: (s.window_pages, s.window_base))
        logits = self.model.forward(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                                    self.k_layers, self.v_layers, meta, torch.tensor(logits_rows, dtype=torch.long))
        for seq, n in seqs:
            seq.num_computed += n
        return StepResult(sampled, logits if sampled or all_logits else None, violations)

    def _spans(self, seqs: list[tuple[Sequence, int]],
               table_of: Callable[[Sequence], tuple[list[int], int]]) -> AttentionMeta:
        """The fast attention's slots, spans and tables for one pool (table_of and positions as in _meta)."""
        ps = self.pool.page_size
        slots: list[int] = []
        spans: list[int] = []  # 5 per sequence: first row, rows, first position, offset in tables, pages
        tables: list[int] = []
        row0 = 0
        for seq, n in seqs:
            table, base = table_of(seq)
            off = base * ps
            start, end = seq.num_computed - off, seq.num_computed + n - off
            npages = pages_for(end, ps)
            spans += (row0, n, start, len(tables), npages)
            tables += table[:npages]
            slots += (table[p // ps] * ps + p % ps for p in range(start, end))
            row0 += n
        return AttentionMeta(slot_mapping=torch.tensor(slots, dtype=torch.long), decode_rows=None,
                             decode_pages=None, decode_mask=None, decode_kv_lens=None, prefills=[],
                             spans=torch.tensor(spans, dtype=torch.long).view(-1, 5),
                             tables=torch.tensor(tables, dtype=torch.long))

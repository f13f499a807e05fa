"""Continuous batching with chunked prefill and preemption by recompute.

Policy, once per step, under a token budget (who goes first among tenants: engine/fairness.py):
  1. running sequences first, oldest first: one token each when decoding, a chunk when still prefilling.
     When pages run out, a running sequence is preempted (pages scrubbed and freed, recomputed later) until
     the older one fits: with fairness vtc one of the tenant most over its share, else the newest.
  2. then waiting sequences, as long as budget and batch slots allow: with fairness vtc from the tenant
     served least (weighted), by priority then arrival within a tenant; with off in arrival order. One whose
     tenant would pass its kv_share of the pool is skipped for this step; so is one whose pages are not free
     now, unless (vtc) its tenant holds no more than its fair share and another tenant holds more: then requests
     of that tenant are preempted to make room (fairness.room_victim).
     A sequence that starts (or restarts) from nothing first takes the longest cached prefix of its prompt
     under its own tenant key and is charged only for the rest; at least its last prompt token is always
     computed, for the logits.
While more than one tenant competes (vtc), the prompt tokens of a step (chunks, recompute) are capped at
contended_chunk_tokens for the running and as much again for those admitted: a newcomer waits for a short step,
and is not kept out of the next one by a running chunk. And when the first request admitted in such a step is of a
tenant with no prompt running here while another tenant's prompt runs, and it was served no more than they were (a
newcomer: one chat among a flood of long prompts), the step is the newcomer's: the other tenants' prompt chunks
sit it out (their pages stay theirs) and only its own tenant's requests are admitted, so its first token waits for
its own short prompt, not for a chunk of another tenant's. Decode tokens are never held back.
Waiting is not a timeout while the engine makes progress: requests wait in the order above, the queue's length is
bounded (max_waiting, then 503 at once), and a busy engine frees pages as it finishes requests. Only a sequence
refused pages at every step for wait_timeout_s while no page at all was freed (nothing can move) ends REJECTED
with 503.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvseal.config import SchedulerConfig
from kvseal.engine.fairness import FairShare, held_pages
from kvseal.engine.sequence import Sequence
from kvseal.kv.allocator import OutOfPages, PageAllocator, pages_for
from kvseal.kv.prefix_cache import PrefixCache
from kvseal.kv.window import WindowPages


@dataclass
class Batch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens fed for each seq this step

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new.append(n)

    def remove(self, seq: Sequence) -> int:
        """Take seq out of this batch; returns the tokens it had."""
        i = self.seqs.index(seq)
        self.seqs.pop(i)
        return self.num_new.pop(i)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, allocator: PageAllocator, page_size: int,
                 cache: PrefixCache | None = None, window: WindowPages | None = None) -> None:
        self.cfg = cfg
        self.window = window  # the sliding layers' own pages (kv/window.py); None: every layer in one pool
        self.allocator = allocator
        self.page_size = page_size
        self.cache = cache if cache is not None else PrefixCache(allocator, enabled=False)
        self.reused_tokens = 0  # prompt tokens taken from the prefix cache instead of computed
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.last_freed = time.monotonic()  # when pages last went back to the free list: progress
        self.on_first_scheduled: Callable[[float], None] | None = None  # metrics: seconds from arrival
        self.fair = FairShare(cfg.fairness)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.fair.activate(seq, {s.tenant for s in self.waiting} | {s.tenant for s in self.running})
        self.waiting.append(seq)

    def schedule(self) -> tuple[Batch, list[Sequence]]:
        """Returns the batch for this step and the sequences preempted to make room."""
        batch, preempted = Batch(), []
        now = time.monotonic()
        budget = self.cfg.max_num_batched_tokens
        busy = {s.tenant for s in self.running} | {s.tenant for s in self.waiting}
        contended = self.fair.contended(busy, now)
        # the tenants with a prompt running here (chunks, recompute), whether or not it gets tokens this step
        prompting = {s.tenant for s in self.running if s.num_tokens - s.num_computed > 1} if contended else set()
        # prompt tokens (chunks, recompute) the running may still take this step; decode tokens are not capped
        chunk = self.cfg.contended_chunk_tokens if contended else budget
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted earlier in this loop
                continue
            n = self._tokens(seq, budget, chunk)
            if n == 0:
                continue
            while not self._grow(seq, seq.num_computed + n):
                victim = self.fair.victim(self.running)
                budget += self._unbatch(victim, batch)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.fair.charge(seq, n)
                batch.add(seq, n)
                budget -= n
                chunk -= n if n > 1 else 0
        squeezed = bool(preempted)  # pages ran out for the running: admit nothing new this step
        if contended:  # the waiting get a cap of their own: a newcomer is not kept out by a running chunk
            chunk = self.cfg.contended_chunk_tokens
        lead: str | None = None  # a newcomer's step: see below
        admitted = 0
        considered: set[int] = set()
        for seq in self.fair.admission_order(self.waiting, self.running):
            if budget == 0 or squeezed or len(self.running) >= self.cfg.max_num_seqs:
                break
            if lead is not None and seq.tenant != lead:
                continue
            considered.add(id(seq))
            n = self._tokens(seq, budget, chunk)
            if n == 0:
                continue
            hit = self._reuse_cached(seq) if not seq.pages and seq.num_computed == 0 else 0
            n = self._tokens(seq, budget, chunk)
            # one that does not fit now is skipped, not waited on: a long recompute at the head of the queue
            # must not block a request that already holds its pages (a verified handoff on decode)
            fits = self._within_share(seq) and (self._grow(seq, seq.num_computed + n)
                                                or self._make_room(seq, n, batch, preempted))
            if not fits:
                if hit:
                    self.release(seq)  # retried from nothing next step; no reference stays held meanwhile
                    seq.num_computed = 0
                if seq.blocked_since is None:
                    seq.blocked_since = now
                continue
            budget = self.cfg.max_num_batched_tokens - sum(batch.num_new)  # room made may have given some back
            self.reused_tokens += hit
            seq.blocked_since = None
            self.waiting.remove(seq)
            self.running.append(seq)
            if seq.first_scheduled is None:
                seq.first_scheduled = now
                self.fair.first_scheduled(seq, now - seq.arrival)
                if self.on_first_scheduled is not None:
                    self.on_first_scheduled(now - seq.arrival)
            if admitted == 0 and prompting and seq.tenant not in prompting and self.fair.least_served(
                    seq.tenant, prompting):
                lead = seq.tenant  # (a tenant over the others' service gets no such step: none starves)
            self.fair.charge(seq, n)
            batch.add(seq, n)
            budget -= n
            chunk -= n if n > 1 else 0
            admitted += 1
        if lead is not None:  # the other tenants' running prompt chunks sit out this one short step
            for s in [s for s, n in zip(batch.seqs, batch.num_new) if s.tenant != lead and n > 1]:
                self._unbatch(s, batch)
        for seq in self.waiting:
            if id(seq) not in considered:
                seq.blocked_since = None  # not reached this step: queued behind compute, not refused pages
        return batch, preempted

    def _tokens(self, seq: Sequence, budget: int, chunk: int) -> int:
        """The tokens seq may feed this step: one to decode, else a chunk within both the budget and the cap."""
        n = min(seq.num_tokens - seq.num_computed, budget)
        return n if n <= 1 else min(n, max(chunk, 0))

    def _unbatch(self, victim: Sequence, batch: Batch) -> int:
        """Take a victim's tokens back out of this step's batch (uncharged); returns them, for the budget."""
        if victim not in batch.seqs:
            return 0
        taken = batch.remove(victim)
        self.fair.charge(victim, taken, sign=-1)
        return taken

    def _make_room(self, seq: Sequence, n: int, batch: Batch, preempted: list[Sequence]) -> bool:
        """vtc: preempt running requests of tenants over their fair share of the pool until seq's next n tokens
        fit (fairness.room_victim decides whether seq may ask and whom it takes from). True when they fit."""
        held = held_pages([*self.running, *self.waiting])
        weights = {s.tenant: s.weight for s in [*self.running, *self.waiting]}
        while (victim := self.fair.room_victim(
                self.running, seq.tenant, seq.priority_class, pages_for(seq.num_computed + n, self.page_size)
                - len(seq.pages), held, weights, self.allocator.num_pages)) is not None:
            held[victim.tenant] -= len(victim.pages)
            self._unbatch(victim, batch)
            self._preempt(victim)
            preempted.append(victim)
            if self._grow(seq, seq.num_computed + n):
                return True
        return False

    def park(self, seq: Sequence) -> None:
        """Take a running sequence out of the batch, its pages kept (prefill: its KV waits for decode to take it;
        it leaves through remove() or release())."""
        self.running.remove(seq)

    def preempt(self, seq: Sequence) -> None:
        """Preempt a running sequence outside a step (decode's reservations make room): pages scrubbed and freed,
        recomputed later, its output so far kept."""
        self._preempt(seq)

    def _within_share(self, seq: Sequence) -> bool:
        """Whether seq may start without its tenant passing its kv_share of the pool. Invariant: the pages a tenant's
        running requests would hold at their longest (prompt + max_tokens) stay within its share, except that a
        tenant running nothing may always start one request (a share never stops a tenant altogether)."""
        if seq.kv_share >= 1.0:
            return True
        mine = [s for s in self.running if s.tenant == seq.tenant]
        if not mine:
            return True
        longest = sum(pages_for(len(s.prompt_ids) + s.params.max_tokens, self.page_size) for s in [*mine, seq])
        return longest <= int(seq.kv_share * self.allocator.num_pages)

    def expired(self, now: float) -> list[Sequence]:
        """Waiting sequences that were never scheduled and were refused pages for longer than the limit, during
        which no page was freed."""
        limit = self.cfg.wait_timeout_s
        return [s for s in self.waiting if s.first_scheduled is None and s.blocked_since is not None
                and now - max(s.blocked_since, self.last_freed) > limit]

    def remove(self, seq: Sequence) -> None:
        """Take seq out of the queues, free its pages (scrubbed by the allocator), drop its cache references."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)

    def _reuse_cached(self, seq: Sequence) -> int:
        """Start seq on the longest cached prefix of its prompt in its own namespace; returns the tokens."""
        limit = (seq.num_tokens - 1) // self.page_size  # the last token is always computed: its logits
        seq.pages = self.cache.acquire(seq.owner, seq.cache_ns, seq.cache_keys[:limit])
        seq.num_computed = len(seq.pages) * self.page_size
        if seq.first_scheduled is None:
            seq.cached_tokens = seq.num_computed
        return seq.num_computed

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Pages for seq's positions up to num_tokens in every table it has; False (nothing more held) if not free
        now."""
        need = pages_for(num_tokens, self.page_size) - len(seq.pages)
        new: list[int] = []
        if need > 0:
            try:
                new = self.allocator.allocate(seq.owner, need)
            except OutOfPages:
                return False
        if self.window is not None and not self.window.grow(seq, num_tokens):
            self.allocator.free(seq.owner, new)  # both tables grow or neither: seq holds nothing more while it waits
            return False
        seq.pages.extend(new)
        return True

    def drop_out_of_window(self, seq: Sequence) -> None:
        """After seq's step: its sliding layers' pages that no later query sees are scrubbed and freed."""
        if self.window is not None and self.window.drop(seq):
            self.last_freed = time.monotonic()

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.owner = self.allocator.next_epoch(seq.owner)  # a stale page table can never pass again
        seq.num_computed = 0
        self.waiting.appendleft(seq)

    def release(self, seq: Sequence) -> None:
        """Free every page seq owns and drop every cached page it holds (at any epoch).

        The owner array and the cache's holder books decide what seq holds, not seq.pages (which may be
        what went wrong)."""
        self.cache.release(seq.owner.key)
        self.allocator.free_all(seq.owner.key)
        seq.pages = []
        if self.window is not None:
            self.window.release(seq)
        self.last_freed = time.monotonic()

"""Continuous batching with chunked prefill and preemption by recompute: each step, a running pass then a waiting
pass under a token budget. Who goes first among tenants is engine/fairness.py's; who may take pages, engine/
admission.py's (kv_share, making room).
  1. running sequences first, oldest first: one token each when decoding, a chunk when still prefilling.
     When pages run out, a running sequence is preempted (pages scrubbed and freed, recomputed later) until
     the older one fits: with fairness vtc one of the tenant most over its share, else the newest.
  2. then waiting sequences, as long as budget and batch slots allow: with fairness vtc from the tenant
     served least (weighted), by priority then arrival within a tenant; with off in arrival order. One whose
     tenant would pass its kv_share is skipped for this step; so is one whose pages are not free now, unless
     (vtc) room is made for it. A sequence that starts (or restarts) from nothing first takes the longest cached
     prefix of its prompt under its own tenant key and is charged only for the rest; at least its last prompt
     token is always computed, for the logits.
While more than one tenant competes (vtc), the prompt tokens of a step (chunks, recompute) are capped at
contended_chunk_tokens for the running and as much again for those admitted: a newcomer waits for a short step,
and is not kept out of the next one by a running chunk. And when the first request admitted in such a step is of a
tenant with no prompt running here while another tenant's prompt runs, and it was served no more than they were (a
newcomer: one chat among a flood of long prompts), the step is the newcomer's: the other tenants' prompt chunks
sit it out (their pages stay theirs) and only its own tenant's requests are admitted, so its first token waits for
its own short prompt, not for a chunk of another tenant's. Decode tokens are never held back.
Waiting is not a timeout while the engine makes progress: the queue's length is bounded (max_waiting, then 503 at
once), and a busy engine frees pages as it finishes requests. Only a sequence refused pages at every step for
wait_timeout_s while no page at all was freed (nothing can move) ends REJECTED with 503.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvseal.config import SchedulerConfig
from kvseal.engine.admission import Admission
from kvseal.engine.fairness import FairShare
from kvseal.engine.requests import Requests
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


@dataclass
class Step:
    """One step's schedule while it is built: its batch, whom it preempted, and what is left of its budgets."""

    now: float
    budget: int  # tokens this step may still feed
    chunk: int  # prompt tokens (chunks, recompute) it may still feed: decode tokens are never capped
    prompting: set[str]  # contended: the tenants with a prompt running here, whether or not it gets tokens now
    batch: Batch = field(default_factory=Batch)
    preempted: list[Sequence] = field(default_factory=list)
    lead: str | None = None  # a newcomer's step: only its tenant is admitted, the others' chunks sit out
    admitted: int = 0
    considered: set[int] = field(default_factory=set)  # waiting sequences this step tried to admit


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, allocator: PageAllocator, page_size: int, requests: Requests,
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
        self.admission = Admission(cfg, self.fair, allocator, page_size, self, requests)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.fair.activate(seq, {s.tenant for s in self.waiting} | {s.tenant for s in self.running})
        self.waiting.append(seq)

    def schedule(self) -> tuple[Batch, list[Sequence]]:
        """Returns the batch for this step and the sequences preempted to make room."""
        now = time.monotonic()
        contended = self.fair.contended({s.tenant for s in self.running} | {s.tenant for s in self.waiting}, now)
        step = Step(now, self.cfg.max_num_batched_tokens,
                    self.cfg.contended_chunk_tokens if contended else self.cfg.max_num_batched_tokens,
                    {s.tenant for s in self.running if self._prompting(s)} if contended else set())
        self._running_pass(step)
        if contended:  # the waiting get a cap of their own: a newcomer is not kept out by a running chunk
            step.chunk = self.cfg.contended_chunk_tokens
        if not step.preempted:  # pages ran out for the running: admit nothing new this step
            self._waiting_pass(step)
        for seq in self.waiting:
            if id(seq) not in step.considered:
                seq.blocked_since = None  # not reached this step: queued behind compute, not refused pages
        return step.batch, step.preempted

    def _running_pass(self, step: Step) -> None:
        """1. The running, oldest first: when pages run out, preempt (fairness.victim) until the older one fits."""
        for seq in list(self.running):
            if step.budget == 0:
                break
            if seq not in self.running:  # preempted earlier in this pass
                continue
            n = self._tokens(seq, step)
            if seq.draft and (n < seq.decode_tokens or not self._grow(seq, seq.num_computed + n)):
                seq.draft = []  # a draft is fed whole or not at all, and never costs anyone their pages
                n = self._tokens(seq, step)
            if n == 0:
                continue
            while not self._grow(seq, seq.num_computed + n):
                victim = self.fair.victim(self.running)
                step.budget += self._unbatch(victim, step.batch)
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._take(seq, n, step)

    def _waiting_pass(self, step: Step) -> None:
        """2. The waiting, in fairness's order, while budget and batch slots allow. One that does not fit now is
        skipped, not waited on: a long recompute at the head of the queue must not block a request that already
        holds its pages (a verified handoff on decode)."""
        for seq in self.fair.admission_order(self.waiting, self.running):
            if step.budget == 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            if step.lead is not None and seq.tenant != step.lead:
                continue
            step.considered.add(id(seq))
            if self._tokens(seq, step) == 0:
                continue
            hit = self._reuse_cached(seq) if not seq.pages and seq.num_computed == 0 else 0
            n = self._tokens(seq, step)
            if self._fits(seq, n, step):
                self._start(seq, n, hit, step)
            else:
                if hit:
                    self.release(seq)  # retried from nothing next step; no reference stays held meanwhile
                    seq.num_computed = 0
                if seq.blocked_since is None:
                    seq.blocked_since = step.now
        if step.lead is not None:  # the other tenants' running prompt chunks sit out this one short step
            for s in [s for s, n in zip(step.batch.seqs, step.batch.num_new) if s.tenant != step.lead
                      and n > s.decode_tokens]:
                self._unbatch(s, step.batch)

    def _fits(self, seq: Sequence, n: int, step: Step) -> bool:
        """Pages for seq's next n tokens, within its tenant's kv_share, with room made (admission.py) if need be."""
        def preempt(victim: Sequence) -> None:
            self._unbatch(victim, step.batch)
            self._preempt(victim)
            step.preempted.append(victim)

        return self.admission.within_kv_share(seq, self.running) and self.admission.make_room(
            seq, pages_for(seq.num_computed + n, self.page_size) - len(seq.pages), [*self.running, *self.waiting],
            lambda: self._grow(seq, seq.num_computed + n), preempt)

    def _start(self, seq: Sequence, n: int, hit: int, step: Step) -> None:
        """A waiting sequence that got its pages joins the running and this step's batch. The first one admitted in
        a contended step, of a tenant with no prompt running here while another's runs and served no more than they
        were (a newcomer: one chat among a flood of long prompts), makes the step its own (`lead`); a tenant over the
        others' service gets no such step: none starves."""
        step.budget = self.cfg.max_num_batched_tokens - sum(step.batch.num_new)  # room made may have given some
        self.reused_tokens += hit
        seq.blocked_since = None
        self.waiting.remove(seq)
        self.running.append(seq)
        if seq.first_scheduled is None:
            seq.first_scheduled = step.now
            self.fair.first_scheduled(seq, step.now - seq.arrival)
            if self.on_first_scheduled is not None:
                self.on_first_scheduled(step.now - seq.arrival)
        if step.admitted == 0 and step.prompting and seq.tenant not in step.prompting and self.fair.least_served(
                seq.tenant, step.prompting):
            step.lead = seq.tenant
        self._take(seq, n, step)
        step.admitted += 1

    def _take(self, seq: Sequence, n: int, step: Step) -> None:
        self.fair.charge(seq, n)
        step.batch.add(seq, n)
        step.budget -= n
        step.chunk -= n if n > seq.decode_tokens else 0

    @staticmethod
    def _prompting(seq: Sequence) -> bool:
        """Still computing its prompt (or recomputing after a preemption): more left than a decode step feeds."""
        return seq.num_target - seq.num_computed > seq.decode_tokens

    @staticmethod
    def _tokens(seq: Sequence, step: Step) -> int:
        """The tokens seq may feed this step: a decode step's (never capped), else a chunk within both the budget and
        the cap on prompt tokens."""
        n = min(seq.num_target - seq.num_computed, step.budget)
        return n if n <= seq.decode_tokens else min(n, max(step.chunk, 0))

    def _unbatch(self, victim: Sequence, batch: Batch) -> int:
        """Take a victim's tokens back out of this step's batch (uncharged); returns them, for the budget."""
        if victim not in batch.seqs:
            return 0
        taken = batch.remove(victim)
        self.fair.charge(victim, taken, sign=-1)
        return taken

    def park(self, seq: Sequence) -> None:
        """Take a running sequence out of the batch, its pages kept (prefill: its KV waits for decode to take it;
        it leaves through remove() or release())."""
        self.running.remove(seq)

    def preempt(self, seq: Sequence) -> None:
        """Preempt a running sequence outside a step (decode's reservations make room): pages scrubbed and freed,
        recomputed later, its output so far kept."""
        self._preempt(seq)

    def expired(self, now: float) -> list[Sequence]:
        """Waiting sequences that were never scheduled and were refused pages for longer than the limit, during
        which no page was freed."""
        return [s for s in self.waiting if s.first_scheduled is None and s.blocked_since is not None
                and self.admission.starved(s.blocked_since, self.last_freed, now, self.cfg.wait_timeout_s)]

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

    def after_step(self, seq: Sequence, n: int) -> None:
        """seq computed n more tokens: its sliding window's pages that no later query sees are dropped, and the
        step that completed its prompt caches the prompt's full pages (final: never written again). Past the seal-5
        check every page here is seq's own or held by it: insert() cannot raise NotOwner."""
        self.drop_out_of_window(seq)
        if seq.cache_keys and seq.num_computed - n < len(seq.prompt_ids) <= seq.num_computed:
            full = len(seq.prompt_ids) // self.page_size
            self.cache.insert(seq.owner, seq.cache_ns, seq.cache_keys[:full], seq.pages[:full])

    def shrink(self, seq: Sequence) -> None:
        """After a draft was rejected: the pages past seq's computed positions, which hold only rejected drafts' KV,
        are scrubbed and freed (a kept page's rejected positions are rewritten by the next step before any query
        reads them)."""
        keep = pages_for(seq.num_computed, self.page_size)
        if keep < len(seq.pages):
            self.allocator.free(seq.owner, seq.pages[keep:])
            del seq.pages[keep:]
            self.last_freed = time.monotonic()
        if self.window is not None:
            self.window.shrink(seq, seq.num_computed)

    def drop_out_of_window(self, seq: Sequence) -> None:
        """After seq's step: its sliding layers' pages that no later query sees are scrubbed and freed."""
        if self.window is not None and self.window.drop(seq):
            self.last_freed = time.monotonic()

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.draft = []  # recomputed from its real tokens alone
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

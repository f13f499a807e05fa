"""Who may take pages now: the one admission policy of an engine. The batch's newcomers (engine/scheduler.py, the
waiting pass) and a decode worker's reservations (engine/kv_reserve.py) ask the same four rules here.

  fair share    a tenant's share of the pool is its weight over the weights of the tenants with work here
                (fairness.fair_share: the one formula)
  kv_share      the pages a tenant's requests would hold at their longest (prompt + max_tokens) stay within its
                kv_share of the pool; a tenant with none may always start one (a share never stops it altogether)
  make room     (vtc) a tenant within its fair share that finds no free pages preempts requests of the tenant most
                over its share (fairness.room_victim) until it fits: recomputed later, their output kept
  reservations  a decode worker grants the queued reservation fairness would admit next, once it fits (with room
                made); no other takes pages ahead of it. Pages that requests here need to run again are not handed
                out, and each request here keeps one page of room to grow. While tenants compete, a tenant gets a
                reservation only while its requests here stay within its fair share. A queue where no page was freed
                for wait_timeout_s cannot move: it is refused (503)
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable
from typing import Protocol

from kvseal.config import SchedulerConfig
from kvseal.engine.fairness import FairShare, fair_share, held_pages
from kvseal.engine.requests import Requests
from kvseal.engine.sequence import Sequence
from kvseal.kv.allocator import PageAllocator, pages_for


class Queues(Protocol):  # what is read here of engine/scheduler.py's Scheduler (importing it: a circle)
    running: list[Sequence]
    waiting: deque[Sequence]
    last_freed: float  # when pages last went back to the free list: progress


class Admission:
    def __init__(self, cfg: SchedulerConfig, fair: FairShare, allocator: PageAllocator, page_size: int,
                 queues: Queues, requests: Requests) -> None:
        self.cfg, self.fair, self.allocator, self.page_size = cfg, fair, allocator, page_size
        self.queues, self.requests = queues, requests

    # -- the rules -----------------------------------------------------------------------------------
    def within_kv_share(self, seq: Sequence, others: Iterable[Sequence]) -> bool:
        """Whether seq may start beside `others` (the running requests, or every request here) without its tenant
        passing its kv_share of the pool."""
        if seq.kv_share >= 1.0:
            return True
        mine = [s for s in others if s.tenant == seq.tenant and s is not seq]
        if not mine:
            return True
        longest = sum(pages_for(len(s.prompt_ids) + s.params.max_tokens, self.page_size) for s in [*mine, seq])
        return longest <= int(seq.kv_share * self.allocator.num_pages)

    def make_room(self, seq: Sequence, need: int, holders: Iterable[Sequence], fits: Callable[[], bool],
                  preempt: Callable[[Sequence], None]) -> bool:
        """Until `fits()`: (vtc) preempt the running request fairness.room_victim names for seq's tenant to get
        `need` more pages, the shares taken among seq's tenant and the tenants of `holders`. True once it fits."""
        held = held_pages(holders)
        weights = {seq.tenant: seq.weight} | {s.tenant: s.weight for s in holders}
        while not fits():
            victim = self.fair.room_victim(self.queues.running, seq.tenant, seq.priority_class, need, held, weights,
                                           self.allocator.num_pages)
            if victim is None:
                return False
            held[victim.tenant] -= len(victim.pages)
            preempt(victim)
        return True

    @staticmethod
    def starved(since: float, last_freed: float, now: float, limit: float) -> bool:
        """Waiting since `since`, with no page freed for longer than `limit`: nothing can move. A queue that is merely
        busy computing never is."""
        return now - max(since, last_freed) > limit

    # -- a decode worker's reservations ------------------------------------------------------------
    def pages_wanted(self, seq: Sequence) -> int:
        return pages_for(len(seq.prompt_ids), self.page_size)

    def pages_available(self, seq: Sequence | None = None) -> int:
        """Free pages seq's reservation (None: any request's) may take. Pages that waiting (e.g. preempted) requests
        need to run again are not handed out, or new arrivals could starve them, except (vtc) those of another tenant
        that would hold more than its fair share with them (as after make_room preempted it for a tenant under its
        share); and every request here keeps one page of room to grow, so that admitting more does not force the ones
        decoding into preemption (their KV dropped and recomputed here)."""
        owed: defaultdict[str, int] = defaultdict(int)
        for s in self.queues.waiting:
            owed[s.tenant] += max(pages_for(s.num_tokens + 1, self.page_size) - len(s.pages), 0)
        here = self.requests.here()
        if seq is not None and self.fair.vtc:
            held = held_pages(here)
            weights = {seq.tenant: seq.weight} | {s.tenant: s.weight for s in here}
            for t in [t for t in owed if t != seq.tenant]:
                if held[t] + owed[t] > fair_share(weights, t, self.allocator.num_pages):
                    del owed[t]
        reserved = sum(1 for s in here if s.reservation is not None)
        compiling = sum(1 for s in here if s.after_grammar is not None)
        growing = len(self.queues.running) + len(self.queues.waiting) + reserved + compiling
        return self.allocator.num_free - sum(owed.values()) - growing

    def fits(self, seq: Sequence) -> bool:
        return self.pages_available(seq) >= self.pages_wanted(seq)

    def may_reserve(self, seq: Sequence) -> bool:
        """Within its kv_share beside every request here, and (vtc, while tenants compete: fairness.competing)
        within its fair share of the pool with its new prompt (a tenant holding none may always reserve). Pages
        reserved ahead of a queued prefill do no work: without this, a flood's reservations took every page, and
        another tenant's chat waited for them to be prefilled and decoded, or preempted decoding requests whose
        recompute slowed everyone."""
        here = self.requests.here()
        if not self.within_kv_share(seq, here):
            return False
        weights = self.fair.competing({seq.tenant: seq.weight} | {s.tenant: s.weight for s in here},
                                      time.monotonic())
        if not self.fair.vtc or len(weights) < 2:
            return True
        mine = sum(len(s.pages) for s in here if s.tenant == seq.tenant)
        return mine == 0 or mine + self.pages_wanted(seq) <= fair_share(weights, seq.tenant,
                                                                         self.allocator.num_pages)

    def next_reservation(self) -> Sequence | None:
        """The queued reservation to grant next: of those whose tenant may reserve, the one fairness picks (a tenant at
        its share waits without holding back the others)."""
        ready = [s for s in self.requests.queued() if self.may_reserve(s)]
        if not ready:
            return None
        held = Counter(s.tenant for s in self.requests.here())  # running, reserved, landing
        return self.fair.pick(ready, lambda s: (s.tenant, s.priority_class, s.priority, s.received), held)

    def make_room_for(self, seq: Sequence, preempt: Callable[[Sequence], None]) -> bool:
        """It fits now, or (vtc) once decoding requests of tenants over their fair share were preempted for it."""
        return self.make_room(seq, self.pages_wanted(seq), self.requests.here(), lambda: self.fits(seq), preempt)

    def overdue(self, now: float) -> list[Sequence]:
        """The queued reservations that cannot move: no page was freed for wait_timeout_s since they came."""
        return [s for s in self.requests.queued()
                if self.starved(s.received, self.queues.last_freed, now, self.cfg.wait_timeout_s)]

"""Which reservation a decode worker may grant now, and the room it may make for one (the worker's queue asks in
order: worker/decode.py). Every request here keeps one page of room to grow; vtc shares the pool among the tenants
with requests here (engine/fairness.py); a kv_share caps a tenant's requests at their longest.
"""

from __future__ import annotations

import time
from collections import defaultdict

from kvseal.engine.engine import Engine
from kvseal.engine.fairness import held_pages
from kvseal.kv.allocator import pages_for
from kvseal.lifecycle import State
from kvseal.wire.messages import GenerateRequest


def pages_for_prompt(e: Engine, num_tokens: int) -> int:
    return pages_for(num_tokens, e.pool.page_size)


def pages_available(e: Engine, req: GenerateRequest | None = None) -> int:
    """Free pages a new reservation (for req) may take. Requests already here come first: pages that waiting
    (e.g. preempted) sequences need to run again are not handed out, or a stream of new arrivals could starve
    them, except (vtc) those of another tenant that would hold more than its fair share of the pool with them
    (as after make_room preempted it for a tenant under its share); and every request here keeps one page of
    room to grow, so that admitting more does not force the ones decoding into preemption (their KV dropped
    and recomputed here)."""
    sched = e.scheduler
    owed: defaultdict[str, int] = defaultdict(int)
    for s in sched.waiting:
        owed[s.tenant] += max(pages_for(s.num_tokens + 1, e.pool.page_size) - len(s.pages), 0)
    if req is not None and sched.fair.vtc:
        held = held_pages(e.seqs.values())
        weights = {req.tenant: req.weight} | {s.tenant: s.weight for s in e.seqs.values()}
        whole = sum(weights.values())
        for t in [t for t in owed if t != req.tenant]:
            if held[t] + owed[t] > weights[t] / whole * e.allocator.num_pages:
                del owed[t]
    growing = len(sched.running) + len(sched.waiting) + e.kv.num_reserved() + len(e.compiling())
    return e.allocator.num_free - sum(owed.values()) - growing


def make_room(e: Engine, req: GenerateRequest) -> bool:
    """vtc: preempt decoding requests of tenants over their fair share of the pool (recomputed here later, output
    so far kept) until req's reservation fits; only for a tenant within its share (fairness.room_victim). The
    shares are those of pages_available: among req's tenant and the tenants of the requests here, so that a
    victim's pages, once it is preempted, are not owed back to it. True when req fits now."""
    need = pages_for_prompt(e, len(req.prompt_ids))
    held = held_pages(e.seqs.values())
    weights = {req.tenant: req.weight} | {s.tenant: s.weight for s in e.seqs.values()}
    while pages_available(e, req) < need:
        victim = e.scheduler.fair.room_victim(e.scheduler.running, req.tenant, req.priority_class, need,
                                              held, weights, e.allocator.num_pages)
        if victim is None:
            return False
        held[victim.tenant] -= len(victim.pages)
        e.scheduler.preempt(victim)
        victim.life.advance(State.ADMITTED)
    return True


def within_fair_reservations(e: Engine, req: GenerateRequest) -> bool:
    """vtc, while tenants compete (fairness.competing): a new reservation is granted to a tenant only while the
    pages its requests here hold, with the new prompt's, stay within its fair share of the pool (a tenant holding
    none may always reserve one). Pages reserved ahead of a queued prefill do no work: without this, a flood's
    reservations took every page, and another tenant's chat waited for them to be prefilled and decoded, or
    preempted decoding requests whose recompute (as long as a prefill, on a CPU) slowed everyone. A tenant
    alone is not held back, and one whose requests grew past its share is preempted only for a tenant under
    its own (make_room)."""
    fair = e.scheduler.fair
    weights = fair.competing({req.tenant: req.weight} | {s.tenant: s.weight for s in e.seqs.values()},
                             time.monotonic())
    if not fair.vtc or len(weights) < 2:
        return True
    mine = sum(len(s.pages) for s in e.seqs.values() if s.tenant == req.tenant)
    share = weights[req.tenant] / sum(weights.values()) * e.allocator.num_pages
    return mine == 0 or mine + pages_for_prompt(e, len(req.prompt_ids)) <= share


def within_share(e: Engine, req: GenerateRequest) -> bool:
    """kv_share for a reservation: this tenant's live requests here at their longest (prompt + max_tokens), with
    req, within its share of the pool; a tenant with none here may always reserve (engine/scheduler.py's rule)."""
    if req.kv_share >= 1.0:
        return True
    mine = [s for s in e.seqs.values() if s.tenant == req.tenant]
    if not mine:
        return True
    longest = sum(pages_for(len(s.prompt_ids) + s.params.max_tokens, e.pool.page_size) for s in mine)
    longest += pages_for(len(req.prompt_ids) + req.params.max_tokens, e.pool.page_size)
    return longest <= int(req.kv_share * e.allocator.num_pages)

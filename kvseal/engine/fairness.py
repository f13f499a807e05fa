"""Who is served next when tenants compete for one engine: the Virtual Token Counter (VTC; Sheng et al., "Fairness
in Serving Large Language Models", OSDI'24).

Each tenant has a counter of the service it got, in weighted tokens: every token fed to the model for it adds
W_PREFILL (a prompt or recomputed token) or W_DECODE (an output token) divided by the tenant's weight. Admission
takes the next request from the waiting tenant with the lowest (priority class, counter); within a tenant, the
lowest `priority` first (vLLM's meaning), then first come, first served. A tenant that becomes active again has its
counter lifted to the lowest counter of the tenants active now (on an idle engine, to the highest of all), so
time away never banks credit. Nothing waits while there is room: a tenant alone gets every slot (work-conserving).

KV pages are shared the same way. A tenant's fair share of a pool is its weight over the weights of the tenants with
work there now. Preemption takes its victim from the running tenant most over its share (highest class, then most
pages per weight, then highest counter), its lowest-priority newest request: when pages run out for a running
request, and (vtc) when a tenant that holds no more than its share waits for pages that another tenant, over its
share, holds (`room_victim`; the victim is recomputed later, its output so far kept). While more than one tenant
has had work within CONTENDED_S, prompt chunks are capped (`contended`): a newcomer waits for a short step, not a
long chunk of another tenant's prompt.

Invariant: while two tenants of a class stay backlogged, their counters differ by at most the largest cost one
admission step can add (a chunk or one decode step of the batch), so the tokens they are served approach the ratio
of their weights. `off` keeps arrival order (FCFS) and preempts the newest request: the baseline the benchmark
compares against.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import TypeVar

from kvseal.engine.sequence import Sequence

Q = TypeVar("Q")
W_PREFILL, W_DECODE = 1.0, 2.0  # VTC's weights: an output token costs about twice a prompt token
FAIRNESS = ("vtc", "off")
CONTENDED_S = 5.0  # a tenant that sent a request this recently still counts as competing (one chat a second does)


@dataclass
class TenantBook:
    """What one engine served a tenant (kept in both modes, for /info and /metrics)."""

    counter: float = 0.0  # VTC: weighted tokens served / weight
    prefill_tokens: int = 0
    decode_tokens: int = 0
    queue_seconds: float = 0.0  # arrival to first scheduled, summed over its requests
    scheduled: int = 0  # requests first scheduled
    weight: float = 1.0


class FairShare:
    def __init__(self, mode: str = "vtc") -> None:
        if mode not in FAIRNESS:
            raise ValueError(f"invalid fairness={mode!r}: use {' or '.join(FAIRNESS)}")
        self.vtc = mode == "vtc"
        self.books: defaultdict[str, TenantBook] = defaultdict(TenantBook)
        self.last_arrival: dict[str, float] = {}  # tenant -> when its latest request arrived (monotonic)

    def activate(self, seq: Sequence, active: set[str]) -> None:
        """seq arrives; `active`: the tenants with a request waiting or running before it."""
        book = self.books[seq.tenant]
        book.weight = seq.weight
        self.last_arrival[seq.tenant] = seq.arrival
        if seq.tenant in active:
            return
        # back after a pause: no credit banked meanwhile. Against the tenants busy now, the least served of them;
        # on an idle engine, the most served of all (an idle point forgets who was served more before it: a tenant
        # that sent a little often must not owe the service it got to one that was away)
        lift = (min(self.books[t].counter for t in active) if active else
                max(b.counter for b in self.books.values()))
        book.counter = max(book.counter, lift)

    def charge(self, seq: Sequence, n: int, sign: int = 1) -> None:
        """n tokens fed for seq this step (sign -1: taken back out of the batch)."""
        book = self.books[seq.tenant]
        decode = seq.num_computed >= len(seq.prompt_ids)  # an output token (recompute counts as prefill)
        if decode:
            book.decode_tokens += sign * n
        else:
            book.prefill_tokens += sign * n
        book.counter += sign * n * (W_DECODE if decode else W_PREFILL) / seq.weight

    def first_scheduled(self, seq: Sequence, waited: float) -> None:
        book = self.books[seq.tenant]
        book.queue_seconds += waited
        book.scheduled += 1

    def admission_order(self, waiting: Iterable[Sequence], running: Iterable[Sequence] = ()) -> Iterator[Sequence]:
        """The waiting sequences in the order to try them. Lazy: each choice reads the counters as charged by the
        admissions before it in the same step. Between equal counters (a tenant back after a pause is lifted to
        the lowest one) the tenant with fewer requests `running` goes first: a newcomer is not put behind the
        tenant that holds the engine by the order of their names."""
        if not self.vtc:
            yield from list(waiting)
            return
        queues: dict[str, list[Sequence]] = {}
        for s in waiting:
            queues.setdefault(s.tenant, []).append(s)
        for q in queues.values():
            q.sort(key=lambda s: (s.priority, s.arrival), reverse=True)  # the next one at the end
        held = Counter(s.tenant for s in running)
        while queues:
            t = min(queues, key=lambda t: (queues[t][-1].priority_class, self.books[t].counter, held[t], t))
            seq = queues[t].pop()
            if not queues[t]:
                del queues[t]
            held[t] += 1
            yield seq

    def least_served(self, tenant: str, others: Iterable[str]) -> bool:
        """vtc: whether tenant's counter is at most every one of the others' (it is due service before them)."""
        counter = self.books[tenant].counter
        return self.vtc and all(counter <= self.books[t].counter for t in others)

    def pick(self, items: Sequence_[Q], describe: Callable[[Q], tuple[str, int, int, float]],
             held: Mapping[str, int] | None = None) -> Q:
        """The item to serve first of a queue kept outside the scheduler (decode's reservations): off, the first;
        vtc, as admission_order would. describe(item) -> (tenant, priority class, priority, arrival); held: each
        tenant's requests in service (the tie-break between equal counters)."""
        if not self.vtc:
            return items[0]
        held = held or {}

        def key(q: Q) -> tuple[int, float, int, str, int, float]:
            tenant, cls, priority, arrival = describe(q)
            counter = self.books[tenant].counter if tenant in self.books else 0.0
            return cls, counter, held.get(tenant, 0), tenant, priority, arrival

        return min(items, key=key)

    def victim(self, running: list[Sequence]) -> Sequence:
        """The running sequence to preempt when pages run out: of the tenant most over its share (highest class,
        then most pages per weight, then highest counter); off, the newest."""
        if not self.vtc:
            return running[-1]
        held = held_pages(running)
        worst = max(running, key=lambda s: (s.priority_class, held[s.tenant] / s.weight,
                                            self.books[s.tenant].counter))
        return self._newest_of(running, worst.tenant)

    def room_victim(self, running: Iterable[Sequence], tenant: str, priority_class: int, need: int,
                    held: Mapping[str, int], weights: Mapping[str, float], total: int) -> Sequence | None:
        """The running sequence to preempt so that `tenant` gets `need` more pages of a pool of `total`, or None.

        held: pages each tenant holds now; weights: the weight of every tenant with work here (tenant included).
        Only with vtc, only for a tenant that stays within its fair share with them (or holds nothing: one request
        always may start), and only from another tenant of the same or a lower class (a higher number) that holds
        more than its own share; of those, the one most over it (pages per weight), its lowest-priority newest. A
        tenant that would pass its share with them (holding nothing) never takes another tenant's last running
        request: the two would preempt each other in turn, each recomputed from nothing, and neither would finish."""
        if not self.vtc:
            return None
        mine = held.get(tenant, 0)
        over = mine + need > fair_share(weights, tenant, total)
        if mine and over:
            return None
        running = list(running)
        others = Counter(s.tenant for s in running)
        candidates = [s for s in running if s.tenant != tenant and s.priority_class >= priority_class
                      and held.get(s.tenant, 0) > fair_share(weights, s.tenant, total)
                      and not (over and others[s.tenant] == 1)]
        if not candidates:
            return None
        worst = max(candidates, key=lambda s: (s.priority_class, held.get(s.tenant, 0) / weights.get(s.tenant, 1.0),
                                               self.books[s.tenant].counter))
        return self._newest_of(candidates, worst.tenant)

    def contended(self, busy: Iterable[str], now: float) -> bool:
        """Whether more than one tenant competes here: has work now (`busy`) or sent a request within CONTENDED_S.
        Off: never (arrival order, full chunks: the baseline)."""
        return self.vtc and len(self.competing({t: 1.0 for t in busy}, now)) > 1

    def competing(self, live: Mapping[str, float], now: float) -> dict[str, float]:
        """tenant -> weight of the tenants that compete here: with work now (`live`, with their weights) or with a
        request within CONTENDED_S. Off: only `live` (nothing is held back for a tenant that is not here)."""
        if not self.vtc:
            return dict(live)
        recent = {t: self.books[t].weight for t, at in self.last_arrival.items() if now - at < CONTENDED_S}
        return recent | dict(live)

    def seen(self, tenant: str, weight: float, now: float) -> None:
        """A request of tenant reached this worker (decode: its reservation, before it joins the engine)."""
        self.books[tenant].weight = weight
        self.last_arrival[tenant] = now

    @staticmethod
    def _newest_of(running: Iterable[Sequence], tenant: str) -> Sequence:
        return max((s for s in running if s.tenant == tenant), key=lambda s: (s.priority, s.arrival))

    def figures(self, running: Iterable[Sequence], waiting: Iterable[Sequence]) -> dict[str, dict[str, float]]:
        """tenant -> what this engine served it, its counter, its weight, and the pages and requests it holds now."""
        pages: defaultdict[str, int] = defaultdict(int)
        counts: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0])
        for s in running:
            pages[s.tenant] += len(s.pages)
            counts[s.tenant][0] += 1
        for s in waiting:
            pages[s.tenant] += len(s.pages)
            counts[s.tenant][1] += 1
        return {t: {"prefill_tokens": b.prefill_tokens, "decode_tokens": b.decode_tokens, "vtc": round(b.counter, 3),
                    "weight": b.weight, "queue_seconds": round(b.queue_seconds, 6), "scheduled": b.scheduled,
                    "kv_pages": pages[t], "running": counts[t][0], "waiting": counts[t][1]}
                for t, b in sorted(self.books.items())}


def fair_share(weights: Mapping[str, float], tenant: str, total: int) -> float:
    """The pages of a pool of `total` that are tenant's fair share: its weight over the weights of the tenants with
    work here (`weights`; a tenant not among them weighs 1)."""
    return weights.get(tenant, 1.0) / sum(weights.values()) * total


def held_pages(seqs: Iterable[Sequence]) -> defaultdict[str, int]:
    """tenant -> the pages its sequences hold."""
    held: defaultdict[str, int] = defaultdict(int)
    for s in seqs:
        held[s.tenant] += len(s.pages)
    return held

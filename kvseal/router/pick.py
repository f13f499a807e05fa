"""Which serving workers may get a request, as the fleet's fairness sees it (router/disagg.py `_pick`).

With `--fairness vtc` a worker serves the tenant it has served least first (engine/fairness.py, as VTC), and within
one tenant first come, first served: what delays a request there is its own tenant's requests ahead of it, plus the
running step, not the other tenants' backlog. So while other tenants have requests in flight on the pool, the
candidates are the workers where the request's tenant has the fewest in flight; among them the usual choice
follows (prefix affinity for prefill, the least loaded). A flooding tenant is spread evenly (its own count is the
same everywhere), and a light tenant goes where nothing of its own waits. With `off` (arrival order: every request
ahead delays it), or with one tenant in flight, every serving worker is a candidate: the least loaded wins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar


class _Worker(Protocol):
    @property
    def fairness(self) -> str: ...

    @property
    def tenant_inflight(self) -> Mapping[str, int]: ...


W = TypeVar("W", bound=_Worker)


def fair_candidates(live: Sequence[W], tenant: str) -> list[W]:
    """The workers of `live` (non-empty, serving) that may get a request of `tenant`."""
    if any(w.fairness != "vtc" for w in live):
        return list(live)
    if not any(t != tenant for w in live for t, n in w.tenant_inflight.items() if n > 0):
        return list(live)  # no other tenant competes: nothing to share
    fewest = min(w.tenant_inflight.get(tenant, 0) for w in live)
    return [w for w in live if w.tenant_inflight.get(tenant, 0) == fewest]

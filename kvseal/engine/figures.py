"""What an engine is and its figures, for display (/info, kvseal doctor, tests); no check reads them. A
disaggregated worker's identity is its WorkerCard (wire/card.py)."""

from __future__ import annotations

from typing import Protocol

import torch

from kvseal.config import EngineConfig
from kvseal.engine.drafts import Drafter
from kvseal.engine.scheduler import Scheduler
from kvseal.engine.sequence import Sequence
from kvseal.engine.structured import Grammars
from kvseal.kernels.arithmetic import Arithmetic
from kvseal.kv.allocator import PageAllocator
from kvseal.kv.pool import KVPool
from kvseal.kv.prefix_cache import PrefixCache
from kvseal.kv.window import WindowPages
from kvseal.ledger.store import Ledger
from kvseal.model.arch import ModelArch
from kvseal.wire.card import WorkerCard
from kvseal.wire.kvspec import KVSpec
from kvseal.wire.roles import Role


class EngineView(Protocol):  # what is read here of engine/engine.py's Engine (importing it: a circle)
    cfg: EngineConfig
    role: Role
    ckpt_name: str
    kv_spec: KVSpec
    context_window: int
    model_window: int
    arch: ModelArch
    pool: KVPool
    prefix_cache: PrefixCache
    kernels: str
    arithmetic: Arithmetic
    device: torch.device
    ledger: Ledger | None
    allocator: PageAllocator
    scheduler: Scheduler
    window: WindowPages | None
    grammars: Grammars
    drafter: Drafter
    pages_scrubbed: int
    ownership_violations: int

    def compiling(self) -> list[Sequence]: ...


def engine_info(e: EngineView) -> dict[str, object]:
    """What this engine is (a unified worker's /info), then its figures."""
    return {
        "role": e.role,
        "model": e.ckpt_name,
        **e.kv_spec.fields(),  # model_fingerprint, page_size, kv_dtype, kv_layout
        "context_window": e.context_window,
        "model_max_position": e.arch.max_position,
        "pool_tokens": e.pool.capacity_tokens,
        "pool_pages": e.pool.num_pages,
        "prefix_cache": e.prefix_cache.enabled,
        "kernels": e.kernels,
        "arithmetic": e.arithmetic.name,
        "arithmetic_isa": e.arithmetic.isa or None,
        "kv_bytes_per_token": e.pool.bytes_per_token,
        "kv_scrub": e.cfg.cache.scrub,
        "device": str(e.device),
        "fairness": e.cfg.scheduler.fairness,
        "speculative": e.cfg.scheduler.speculative if e.drafter.on else "off",
        "ledger": None if e.ledger is None else str(e.ledger.path),
        **engine_figures(e),
    }


def engine_card(e: EngineView, **worker: object) -> WorkerCard:
    """A worker's card (wire/card.py): what its engine is, and `worker`'s own fields (role, instance, transport,
    tokenizer digest, test faults, fleet auth, reservation timeout)."""
    return WorkerCard(
        model=e.ckpt_name, kv=e.kv_spec, kernels=e.kernels, arithmetic=e.arithmetic.name,
        arithmetic_isa=e.arithmetic.isa or None, model_window=e.model_window, model_max_position=e.arch.max_position,
        context_window=e.context_window, pool_pages=e.pool.num_pages, pool_tokens=e.pool.capacity_tokens,
        kv_bytes_per_token=e.pool.bytes_per_token, kv_scrub=e.cfg.cache.scrub, prefix_cache=e.prefix_cache.enabled,
        fairness=e.cfg.scheduler.fairness, device=str(e.device),
        ledger=None if e.ledger is None else str(e.ledger.path), **worker)  # type: ignore[arg-type]


def engine_figures(e: EngineView) -> dict[str, object]:
    """What changes from one step to the next: pages, requests, tenants, counters."""
    sched, window, grammars = e.scheduler, e.window, e.grammars.pool
    return {
        # free_pages: what a new request can get now, the free list plus unreferenced cached pages (evicted
        # and scrubbed on demand); equal to pool_pages whenever no request holds a page (seal 8)
        "free_pages": e.allocator.num_free,
        "owned_pages": e.allocator.num_owned,
        "cached_pages": e.prefix_cache.num_cached,
        "cached_pages_in_use": e.prefix_cache.num_referenced,
        "prefix_cache_hit_tokens": sched.reused_tokens,
        "prefix_cache_evicted_pages": e.prefix_cache.evicted_pages,
        # the sliding layers' own pool (kv/window.py): their window, pages, free pages, pages dropped so far
        "window_pool": None if window is None else {
            "window": window.window, "layers": len(window.layers), "pages": window.pool.num_pages,
            "free_pages": window.allocator.num_free, "dropped_pages": window.pages_dropped},
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        # per tenant: tokens served, VTC counter, weight, queue time, pages held (engine/fairness.py)
        "tenants": sched.fair.figures(sched.running, sched.waiting),
        "pages_scrubbed": e.pages_scrubbed,
        "ownership_violations": e.ownership_violations,
        # response_format: requests waiting for their grammar, compiler processes, compiles killed at the limit
        "waiting_for_grammar": len(e.compiling()),
        "grammar_compilers": 0 if grammars is None else len(grammars.pids),
        "grammar_compiles_killed": 0 if grammars is None else grammars.killed,
        # speculative decoding (engine/drafts.py): draft tokens verified, kept, and requests' steps that verified one
        "spec_drafted_tokens": e.drafter.drafted,
        "spec_accepted_tokens": e.drafter.accepted,
        "spec_drafts": e.drafter.steps,
    }

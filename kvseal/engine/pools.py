"""An engine's KV pools: one for every layer, or (a unified engine whose model has sliding-window layers) one for
the full-attention layers and one that keeps only each sequence's window for the sliding ones (kv/window.py)."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Pages

import torch

from kvseal.config import EngineConfig
from kvseal.kv.allocator import pages_for
from kvseal.kv.pool import KVPool, pool_num_pages
from kvseal.kv.window import WindowPages, split_pages, split_window
from kvseal.model.arch import ModelArch
from kvseal.wire.roles import Role


def build_pools(arch: ModelArch, windows: tuple[int, ...], cfg: EngineConfig, role: str, kv_dtype: torch.dtype,
                device: torch.device, layout: str, model_window: int,
                count_scrubbed: Callable[[Pages[int]], None]) -> tuple[KVPool, WindowPages | None]:
    """(the pool, the sliding layers' pool or None). A handoff moves a page as every layer's KV, so only a unified
    engine splits; count_scrubbed counts the window pool's scrubbed pages (it zeroes them itself)."""
    num_pages = pool_num_pages(arch, cfg.cache, kv_dtype, default_tokens=2 * model_window)
    ps, window = cfg.cache.page_size, None
    if role == Role.UNIFIED and cfg.cache.window_pages and split_window(windows):
        sched, windowed = cfg.scheduler, sum(1 for w in windows if w)
        num_pages, wpages = split_pages(num_pages, arch.num_layers - windowed, windowed, split_window(windows), ps,
                                        sched.max_num_seqs, sched.max_num_batched_tokens,
                                        sched.max_num_seqs * pages_for(model_window, ps))
        window = WindowPages(arch, windows, wpages, ps, kv_dtype, device,
                             scrub=count_scrubbed if cfg.cache.scrub else None, layout=layout)
    pool = KVPool(arch, num_pages, ps, kv_dtype, device, layout=layout,
                  num_layers=None if window is None else len(window.full_layers))
    return pool, window

"""Sliding-window layers keep only their window of KV pages (Mistral, Gemma 3's local layers).

A unified engine whose model has sliding-window layers (one window W, shorter than what it serves) splits its KV in
two pools, as SGLang's SWA pool and vLLM's per-group block tables do:
  - the main pool (kv/pool.py, the engine's `pool`) holds the full-attention layers at every position, under the
    sequence's `pages`, as for any model (a Mistral, all of whose layers slide, keeps zero layers there: its pages
    still count the sequence's positions against the context window);
  - the window pool (here) holds the sliding layers, under the sequence's own `window_pages`, and only for the
    positions its next query can still see.
Each pool has its own PageAllocator (owner array, scrub on free, check_integrity); a sequence's owner (request key,
epoch) is the same in both, and the runner checks both tables before each forward pass (seal 5).

A sequence's window table: window_pages[j] holds the sliding layers' KV of positions (window_base + j) * S .. + S - 1;
the pages before window_base were dropped. A query at position p sees keys p - W + 1 .. p, so once a step has
computed num_computed positions, every page that ends before num_computed - W + 1 is dropped: freed through its
allocator (owner checked, scrubbed: seal 6; back on the free list: seal 8), exactly as a request's pages are freed
when it ends. Preemption and the end of a request free the rest (release), whatever the table says.

Sizing (split_pages): the bytes of the pool as configured (--kv-pool-tokens / --kv-pool-bytes, pages of every layer)
are shared: the window pool gets what max_num_seqs running sequences can hold at once, the main pool the rest, so it
holds more positions than configured (a longer served window, or more long requests at once) in the same memory.
Not split (every layer in the main pool, as before): the prefill and decode roles (the handoff moves a page as every
layer's KV, docs/architecture.md), and models whose layers slide by different windows.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Pages
from typing import Protocol

import torch

from kvseal.kv.allocator import OutOfPages, Owner, PageAllocator, pages_for
from kvseal.kv.pool import KVPool
from kvseal.model.arch import ModelArch


class Windowed(Protocol):
    """What the window pool reads and keeps of a sequence (engine/sequence.py): its owner, how far it computed, and
    its window table."""

    owner: Owner
    num_computed: int
    window_pages: list[int]
    window_base: int


def split_window(windows: tuple[int, ...]) -> int:
    """The one window the sliding layers share (0: no layer slides, or they slide by different windows)."""
    sizes = {w for w in windows if w}
    return sizes.pop() if len(sizes) == 1 else 0


def split_pages(pages: int, full_layers: int, window_layers: int, window: int, page_size: int, max_num_seqs: int,
                budget: int, most_pages: int) -> tuple[int, int]:
    """(main pool pages, window pool pages) in the bytes of `pages` pages of every layer (the pool as configured).

    The window pool holds what running sequences can hold at once: after a step each keeps at most
    pages_for(window - 1) + 1 pages, and a step adds at most one page more per sequence plus the pages of its `budget`
    tokens. The main pool takes the rest of the bytes: never fewer pages than configured, never more than
    `most_pages` (every sequence at the longest context; all of them when no layer is full, as in Mistral)."""
    wpages = min(pages, max_num_seqs * (pages_for(window - 1, page_size) + 2) + pages_for(budget, page_size))
    if full_layers == 0:
        main = most_pages
    else:
        main = (pages * (full_layers + window_layers) - wpages * window_layers) // full_layers
    main = max(pages, min(main, most_pages))
    return main, min(wpages, main)


class WindowPages:
    def __init__(self, arch: ModelArch, windows: tuple[int, ...], num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device, scrub: Callable[[Pages[int]], None] | None,
                 layout: str = "std") -> None:
        """windows: per layer, the window that matters (LlamaModel.windows); split_window(windows) > 0.
        scrub: called with the pages dropped or freed, after this pool zeroed them (None: no scrubbing)."""
        self.window = split_window(windows)
        if not self.window:
            raise ValueError(f"no single sliding window among the layers' windows {windows}")
        self.layers = tuple(i for i, w in enumerate(windows) if w)  # in the window pool, in this order
        self.full_layers = tuple(i for i, w in enumerate(windows) if not w)  # in the main pool, in this order
        self.page_size = page_size
        self.pool = KVPool(arch, num_pages, page_size, dtype, device, layout, num_layers=len(self.layers))
        self._on_scrub = scrub
        self.allocator = PageAllocator(num_pages, scrubber=self._scrub if scrub is not None else None)
        self.pages_dropped = 0  # pages freed because they left a sequence's window (for /info)

    def _scrub(self, pages: Pages[int]) -> None:
        self.pool.scrub(pages)
        assert self._on_scrub is not None
        self._on_scrub(pages)

    def layer_caches(self, main: KVPool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per model layer, the K and V cache it reads: views of one layer of the main pool or of this one."""
        where = {layer: (main, j) for j, layer in enumerate(self.full_layers)}
        where.update({layer: (self.pool, j) for j, layer in enumerate(self.layers)})
        order = [where[i] for i in range(len(where))]
        return [p.k[j] for p, j in order], [p.v[j] for p, j in order]

    def first_needed(self, num_computed: int) -> int:
        """Index of the first page the next query (at position num_computed) sees: the earlier ones may go."""
        return max(0, num_computed - self.window + 1) // self.page_size

    def grow(self, seq: Windowed, num_tokens: int) -> bool:
        """Window pages for seq's positions up to num_tokens (from window_base on); False if not free now."""
        need = pages_for(num_tokens, self.page_size) - seq.window_base - len(seq.window_pages)
        if need <= 0:
            return True
        try:
            seq.window_pages.extend(self.allocator.allocate(seq.owner, need))
        except OutOfPages:
            return False
        return True

    def drop(self, seq: Windowed) -> int:
        """Free (scrubbed) seq's window pages that no later query can see; returns how many. NotOwner (nothing
        changed) if seq does not own them: the runner checked it does before the step."""
        n = min(self.first_needed(seq.num_computed) - seq.window_base, len(seq.window_pages))
        if n <= 0:
            return 0
        self.allocator.free(seq.owner, seq.window_pages[:n])
        del seq.window_pages[:n]
        seq.window_base += n
        self.pages_dropped += n
        return n

    def shrink(self, seq: Windowed, num_tokens: int) -> None:
        """Free (scrubbed) seq's window pages past position num_tokens: a draft's rejected positions."""
        keep = max(0, pages_for(num_tokens, self.page_size) - seq.window_base)
        if keep < len(seq.window_pages):
            self.allocator.free(seq.owner, seq.window_pages[keep:])
            del seq.window_pages[keep:]

    def owns(self, seq: Windowed) -> bool:
        """Seal 5 for the window table: every page in it is seq's own (no page here is ever shared)."""
        return self.allocator.owns(seq.owner, seq.window_pages)

    def release(self, seq: Windowed) -> None:
        """Free every window page seq's key owns (any epoch), scrubbed; the table starts again at position 0."""
        self.allocator.free_all(seq.owner.key)
        seq.window_pages = []
        seq.window_base = 0

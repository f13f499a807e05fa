"""Keep large buffers in the heap: every step allocates a few MB (logits, scratch), and glibc's default returns
them to the kernel with munmap and takes them back with page faults on the next step (7% of a 32-stream decode
step went to zeroing fresh pages). Raising the mmap and trim thresholds once per process keeps those pages."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import cache

log = logging.getLogger("kvseal.memory")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


@cache
def keep_freed_pages(threshold: int = 256 * 2**20) -> bool:
    """mallopt(M_MMAP_THRESHOLD and M_TRIM_THRESHOLD, threshold): allocations below it come from the heap, and
    the heap is not trimmed below it. True when glibc took both; a no-op elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        ok = bool(libc and libc.mallopt(M_MMAP_THRESHOLD, min(threshold, 32 * 2**20))
                  and libc.mallopt(M_TRIM_THRESHOLD, threshold))
    except (OSError, AttributeError):
        ok = False
    log.debug("malloc thresholds raised: %s", ok)
    return ok

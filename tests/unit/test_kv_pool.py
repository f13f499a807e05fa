"""The KV pool's tensors (kv/pool.py): zeros from the start, in memory the kernel zeroes page by page on first touch,
so that creating a pool of gigabytes neither takes seconds nor holds the memory before pages are used."""

from __future__ import annotations

import os

import pytest
import torch

from kvseal.kv.pool import KVPool
from kvseal.model.arch import ModelArch

ARCH = ModelArch("llama", 100, 64, 128, 4, 4, 2, 64, 1e4, 1e-5, 4096, True, False)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("layout", ["std", "kt"])
def test_a_new_pool_is_zero_everywhere_and_takes_writes_and_scrubs(layout: str) -> None:
    pool = KVPool(ARCH, 32, 16, torch.bfloat16, torch.device("cpu"), layout)
    assert pool.k.is_contiguous() and pool.v.is_contiguous()
    assert not pool.k.any() and not pool.v.any()
    k = torch.randn(ARCH.num_layers, 2, 16, 2, 64)
    pool.write_pages([3, 7], k, k * 2)
    rk, rv = pool.read_pages([3, 7])
    assert torch.equal(rk, k.bfloat16()) and torch.equal(rv, (k * 2).bfloat16())
    pool.scrub([3])
    rk, _ = pool.read_pages([3, 7])
    assert not rk[:, 0].any() and torch.equal(rk[:, 1], k[:, 1].bfloat16())


def test_a_pool_holds_no_memory_until_its_pages_are_used() -> None:
    """256 MB of pool: RSS grows by what is written, not by the pool (torch.zeros wrote every page at start)."""
    arch = ModelArch("llama", 100, 64, 128, 8, 4, 2, 128, 1e4, 1e-5, 4096, True, False)
    before = rss_bytes()
    pool = KVPool(arch, 1024, 16, torch.float32, torch.device("cpu"), "kt")
    assert pool.nbytes == 256 * 2**20
    created = rss_bytes()
    assert created - before < 32 * 2**20, (created - before) / 2**20
    pool.write_pages(range(64), torch.ones(8, 64, 16, 2, 128), torch.ones(8, 64, 16, 2, 128))
    used = rss_bytes() - created  # 64 of 1024 pages: 16 MB, and the staging tensors
    assert 8 * 2**20 < used < 96 * 2**20, used / 2**20
    assert int(pool.k[:, 64:].count_nonzero()) == 0 and int(pool.k[:, :64].count_nonzero()) == pool.k[:, :64].numel()

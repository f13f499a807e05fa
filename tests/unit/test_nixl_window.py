"""The export window's page copy (transfer/nixl_window.py): every offered page lands in its slot, on both layouts
(kt keeps K transposed inside a page), whether the pages are runs (slice copies) or scattered (a gather), and no
other slot is written."""

from __future__ import annotations

import random

import pytest
import torch

from kvseal.transfer.nixl_window import copy_pages, page_blocks

CASES = [([4, 5, 6], [0, 1, 2]), ([7, 2, 9, 1], [3, 4, 5, 6]), (list(range(10)), list(range(10))), ([], []),
         (random.Random(0).sample(range(20), 10), list(range(10))), ([3, 4, 5, 11, 12], [5, 6, 7, 0, 1])]


@pytest.mark.parametrize("shape", [(3, 20, 4, 2, 8), (3, 20, 2, 8, 4), (2, 20, 3, 5, 1)])
@pytest.mark.parametrize(("src", "dst"), CASES)
def test_each_page_lands_in_its_slot_and_nowhere_else(shape: tuple[int, ...], src: list[int], dst: list[int]) -> None:
    pool = torch.randn(shape).to(torch.bfloat16)
    win = torch.zeros(shape[0], 10, *shape[2:], dtype=torch.bfloat16)
    copy_pages(page_blocks(pool), src, page_blocks(win), dst)
    for s, d in zip(src, dst):
        assert torch.equal(win[:, d], pool[:, s])
    assert not win[:, [i for i in range(10) if i not in dst]].any()

"""Two processes that load the same GGUF at the same time (the prefill and decode workers of `kvseal serve`): one
builds the weights cache, the other waits on its lock and maps the result, and both then hold the same physical
pages (each page counts once in the sum of their PSS, twice in the sum of their RSS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.memory import file_residency_kb

pytestmark = pytest.mark.integration

CHILD = """
import json, sys, torch
from kvseal.model.gguf import load_gguf
from kvseal.model.llama import LlamaModel
from kvseal.model.locate import default_model_path
from tests.helpers.memory import weight_tensors

m = LlamaModel(load_gguf(default_model_path(), progress=False), torch.float32, torch.device("cpu"), native=True,
               fast=True)
touched = 0
for w in [m.lm_head] + [x for ly in m.layers for x in (ly.wqkv, ly.wo, ly.w_gate_up, ly.w_down)]:
    for t in weight_tensors(w):
        touched += int(t.reshape(-1).view(torch.uint8)[::4096].sum())  # a byte of every page, as a forward reads
print(json.dumps({"cache": str(m.weights_cache), "built": m.weights_cache_built}), flush=True)
sys.stdin.read()  # hold the pages until the parent has looked
"""


def test_two_processes_build_once_and_share_the_pages(tmp_path: Path) -> None:
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "KVSEAL_WEIGHTS_CACHE_DIR": str(tmp_path / "weights"),
           "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
             for _ in range(2)]
    try:
        infos = [json.loads(p.stdout.readline() or "{}") for p in procs]  # type: ignore[union-attr]
        assert all(infos), "a child died before reporting"
        assert sorted(i["built"] for i in infos) == [False, True]  # one built it; the other waited, then mapped
        cache = infos[0]["cache"]
        assert infos[1]["cache"] == cache
        size_kb = os.path.getsize(cache) / 1024
        (rss_a, pss_a), (rss_b, pss_b) = (file_residency_kb(cache, p.pid) for p in procs)
        assert min(rss_a, rss_b) > 0.9 * size_kb  # each has the whole file resident
        assert pss_a + pss_b < 0.6 * (rss_a + rss_b)  # ... in pages both share: PSS halves each one
    finally:
        for p in procs:
            p.stdin.close()  # type: ignore[union-attr]
            p.wait(timeout=60)

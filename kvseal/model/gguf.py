"""Loading a llama.cpp GGUF file (llama or qwen2 architecture) into a Checkpoint, in place.

The file is memory-mapped (model/gguf_file.py). Every matrix stored in GGML blocks stays there: a QuantTensor
view, read-only, never dequantized as a whole. Float tensors (norms, biases, float matrices) are copied as
float32. Names become their Hugging Face names. For the llama architecture llama.cpp's converter permuted the
rows of q/k (from HF's rotate-half order to interleaved pairs); a QuantTensor carries the row order that undoes
it (exactly as transformers' `LlamaTensorProcessor._reverse_permute_weights`), so its rows dequantize to those of
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`. Qwen2 GGUFs are not permuted.
The fingerprint and the content key come from the file's bytes (model/file_index.py), not from floats.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from kvseal.kernels.ops import BLOCKS
from kvseal.model.checkpoint import Checkpoint, ModelArch
from kvseal.model.file_index import file_digests
from kvseal.model.gguf_file import GGUFFile, TensorInfo
from kvseal.model.gguf_tokenizer import gguf_field
from kvseal.model.layout import check_weights
from kvseal.model.quant import QuantTensor
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


def _require(reader: GGUFFile, key: str) -> Any:
    value = gguf_field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata lacks {key!r}; cannot build the model architecture")
    return value


def _rope_scaling(reader: GGUFFile, arch: str) -> tuple[tuple[str, Any], ...] | None:
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


def arch_from_gguf(reader: GGUFFile) -> ModelArch:
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


def _row_order(gguf_name: str, arch: ModelArch, rows: int) -> np.ndarray | None:
    """For llama q/k: HF row r is stored at file row order[r] (llama.cpp's permutation, undone); else None."""
    if arch.family != "llama" or not (".attn_q." in gguf_name or ".attn_k." in gguf_name):
        return None
    heads = arch.num_heads if ".attn_q." in gguf_name else arch.num_kv_heads
    if rows % (2 * heads):
        raise ValueError(f"GGUF tensor {gguf_name!r} has {rows} rows, not a whole number of {heads} rotary heads")
    return reverse_permute(np.arange(rows, dtype=np.int64), heads)


def _packs(t: TensorInfo) -> bool:
    """A matrix the loader keeps as stored: every quantized one, and floats the kernels take as they are (rows of
    a multiple of 32)."""
    block = gguf.GGML_QUANT_SIZES[t.tensor_type][0]
    return len(t.shape) == 2 and (block > 1 or (int(t.tensor_type) in BLOCKS and t.shape[0] % 32 == 0))


def _packed(f: GGUFFile, t: TensorInfo, arch: ModelArch) -> QuantTensor:
    rows, cols = t.rows_cols
    order = _row_order(t.name, arch, rows)
    return QuantTensor(int(t.tensor_type), rows, cols, f.tensor_bytes(t).view(rows, -1),
                       None if order is None else torch.from_numpy(order), t.offset)


def _float(f: GGUFFile, t: TensorInfo, arch: ModelArch) -> torch.Tensor:
    """A float32 copy of a float tensor (or of a quantized vector); norms, biases, float weights."""
    raw = f.tensor_bytes(t).numpy()
    try:
        w = gguf.quants.dequantize(raw, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(
            f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which the installed gguf package cannot "
            f"dequantize ({e}); re-quantize the model to a supported type (e.g. Q8_0, Q4_K)"
        ) from e
    shape = tuple(reversed(t.shape))  # GGUF lists dims innermost first
    w = np.array(w, dtype=np.float32, copy=True).reshape(shape)  # owned: the map is read-only
    order = _row_order(t.name, arch, shape[0]) if len(shape) == 2 else None
    return torch.from_numpy(w if order is None else np.ascontiguousarray(w[order]))


def checkpoint_name(path: Path, reader: GGUFFile) -> str:
    """A display name: the file stem without its quantization suffix, else general.name."""
    stem = _QUANT_SUFFIX_RE.sub("", path.stem)
    return stem or str(gguf_field(reader, "general.name", path.name))


def load_gguf(path: str, progress: bool = True) -> Checkpoint:
    """Map a GGUF file: quantized matrices stay where they lie (QuantTensor views), float tensors are copied as
    float32; HF names and shapes. The first load of a file hashes it (model/file_index.py)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"GGUF file {str(file)!r} does not exist")
    return checkpoint_from_gguf(GGUFFile(file), progress=progress)


def checkpoint_from_gguf(f: GGUFFile, progress: bool = True) -> Checkpoint:
    """load_gguf for an already opened file."""
    file = Path(f.path)
    arch = arch_from_gguf(f)
    weights: dict[str, torch.Tensor] = {}
    packed: dict[str, QuantTensor] = {}
    for t in f.tensors:
        name = hf_tensor_name(t.name, arch.num_layers)
        if _packs(t):
            packed[name] = _packed(f, t, arch)
        else:
            weights[name] = _float(f, t, arch)
    check_weights({**weights, **packed}, arch, str(file))
    digests = file_digests(f, progress=progress)
    return Checkpoint(
        arch=arch,
        weights=weights,
        tokenizer=Tokenizer.from_gguf_fields(f),
        name=checkpoint_name(file, f),
        source=str(file),
        fingerprint=digests.fingerprint(f, repr(arch)),
        packed=packed,
        content_key=digests.content_key,
        mapped=f,
    )

"""Loading a llama.cpp GGUF file (llama (also Llama 3 and Mistral), qwen2, qwen3 or gemma3) into a Checkpoint, in place.

The file is memory-mapped (model/gguf_file.py). Every matrix stored in GGML blocks stays there: a QuantTensor
view, read-only, never dequantized as a whole. Float tensors (norms, biases, float matrices) are copied as
float32. Names become their Hugging Face names. For the llama architecture llama.cpp's converter permuted the
rows of q/k (from HF's rotate-half order to interleaved pairs); a QuantTensor carries the row order that undoes
it (exactly as transformers' `LlamaTensorProcessor._reverse_permute_weights`), so its rows dequantize to those of
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`. Qwen2/3 and Gemma 3 GGUFs are not permuted.
What the file leaves to llama.cpp's code is filled in as llama.cpp fills it: Llama 3's `rope_freqs` divisors (or the
HF llama3 scaling they were made from, when they match it), Gemma 3's local rope base (1e4), its every-6th-layer
global pattern when the file states none, its query scale (head_dim; hidden / heads for the 62-layer 27B) and
sqrt(hidden) embedding scale. Gemma's norms are stored with their 1 added (checkpoint.Checkpoint's convention).
The fingerprint and the content key come from the file's bytes (model/file_index.py), not from floats.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from kvseal.kernels.weights import BLOCKS
from kvseal.model.arch import ModelArch
from kvseal.model.checkpoint import Checkpoint
from kvseal.model.file_index import file_digests
from kvseal.model.gguf_file import GGUFFile, TensorInfo
from kvseal.model.gguf_tokenizer import gguf_field, tokenizer_from_gguf_reader
from kvseal.model.layout import check_weights
from kvseal.model.locate import checkpoint_name
from kvseal.model.quant import QuantTensor

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # llama.cpp's rope_freq_base_train_swa for gemma3 (not in the file)
GEMMA3_PATTERN = 6  # llama.cpp's default: layers il % 6 < 5 slide, every 6th is global
# Llama 3.x's HF rope_scaling, less the factor (what rope_freqs divisors are checked against)
LLAMA3_BANDS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma 3's sandwich: llama.cpp's ffn_norm is its pre-feed-forward norm, post_attention_norm the one after attention
_GEMMA3_NAMES = {**_BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's rope divisors: part of the arch, not a weight
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# File-name suffixes naming a quantization ("SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct").


def hf_tensor_name(gguf_name: str, num_layers: int, family: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor; ValueError for tensors this loader does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_NAMES if family == "gemma3" else _BLOCK_NAMES
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in names and int(m.group(1)) < num_layers:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in a {family} model")


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


def llama_cpp_rope_factors(theta: float, head_dim: int, scaling: dict[str, float]) -> torch.Tensor:
    """The rope_freqs divisors llama.cpp's converter writes for HF llama3 rope scaling (its arithmetic: float32)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return torch.where(wavelen < old / high, 1.0, torch.where(wavelen > old / low, factor, medium)).float()


def _rope_freqs(f: GGUFFile, theta: float, head_dim: int) -> tuple[tuple[str, Any], ...]:
    """rope_scaling from a rope_freqs tensor: HF's llama3 scaling when the divisors are the ones it makes with Llama
    3.x's bands (then the frequencies are transformers' to the bit), else the divisors as they are."""
    t = f.tensor(ROPE_FREQS)
    factors = torch.from_numpy(np.array(gguf.quants.dequantize(f.tensor_bytes(t).numpy(), t.tensor_type),
                                        dtype=np.float32).reshape(-1))
    if factors.numel() != head_dim // 2:
        raise ValueError(f"GGUF {ROPE_FREQS} has {factors.numel()} divisors; head_dim {head_dim} needs {head_dim // 2}")
    bands = {"factor": float(factors.max()), **LLAMA3_BANDS}
    if torch.allclose(llama_cpp_rope_factors(theta, head_dim, bands), factors, rtol=1e-5, atol=0):
        return tuple(sorted({"rope_type": "llama3", **bands}.items()))
    return (("factors", tuple(float(x) for x in factors)), ("rope_type", "freq_factors"))


def _windows(reader: GGUFFile, arch: str, layers: int) -> tuple[int, ...]:
    """Per layer, the sliding window (0: global), as llama.cpp reads sliding_window and sliding_window_pattern."""
    window = gguf_field(reader, f"{arch}.attention.sliding_window")
    if not window:
        return ()
    pattern = gguf_field(reader, f"{arch}.attention.sliding_window_pattern",
                         GEMMA3_PATTERN if arch == "gemma3" else 0)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"GGUF {arch}.attention.sliding_window_pattern has {len(pattern)} entries for "
                             f"{layers} layers")
        slides = [bool(x) for x in pattern]
    else:
        n = int(pattern)
        slides = [n == 0 or i % n < n - 1 for i in range(layers)]
    return tuple(int(window) if s else 0 for s in slides)


def _gemma3(reader: GGUFFile, hidden: int, heads: int, head_dim: int, layers: int) -> dict[str, Any]:
    if gguf_field(reader, "gemma3.attn_logit_softcapping") is not None:
        raise ValueError("GGUF gemma3.attn_logit_softcapping is set; transformers' and llama.cpp's Gemma 3 do not "
                         "apply it, so kvseal refuses rather than guess")
    final = gguf_field(reader, "gemma3.final_logit_softcapping")
    return {"qk_norm": True, "sandwich_norms": True, "mlp_act": "gelu_tanh", "embed_scale": hidden**0.5,
            "local_rope_theta": GEMMA3_LOCAL_ROPE_THETA,
            "attn_scalar": float(hidden // heads if layers == 62 else head_dim),  # llama.cpp: the 27B is the one
            "final_softcap": None if final is None else float(final)}


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
    layers = int(_require(reader, f"{arch}.block_count"))
    theta = float(gguf_field(reader, f"{arch}.rope.freq_base", 1e6 if arch == "gemma3" else 10000.0))
    scaling = _rope_scaling(reader, arch)
    if ROPE_FREQS in names:
        if scaling is not None:
            raise ValueError(f"GGUF has both {ROPE_FREQS} and {arch}.rope.scaling.type; which applies is unclear")
        scaling = _rope_freqs(reader, theta, head_dim)
    extra: dict[str, Any] = {"qk_norm": "blk.0.attn_q_norm.weight" in names}
    if arch == "gemma3":
        extra = _gemma3(reader, hidden, heads, head_dim, layers)
    return ModelArch(
        family=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_require(reader, f"{arch}.feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=theta,
        rms_eps=float(_require(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position=int(_require(reader, f"{arch}.context_length")),
        tie_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        rope_scaling=scaling,
        layer_windows=_windows(reader, arch, layers),
        **extra,
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
        if t.name == ROPE_FREQS:  # read into arch.rope_scaling
            continue
        name = hf_tensor_name(t.name, arch.num_layers, arch.family)
        if _packs(t):
            packed[name] = _packed(f, t, arch)
        else:
            weights[name] = _float(f, t, arch)
    check_weights({**weights, **packed}, arch, str(file))
    digests = file_digests(f, progress=progress)
    return Checkpoint(
        arch=arch,
        weights=weights,
        tokenizer=tokenizer_from_gguf_reader(f),
        name=checkpoint_name(file, f),
        source=str(file),
        fingerprint=digests.fingerprint(f, repr(arch)),
        packed=packed,
        content_key=digests.content_key,
        mapped=f,
    )

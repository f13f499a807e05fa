"""Writing a tiny HF folder (see tiny_models.py) out as a GGUF, the way llama.cpp's converter does.

For the llama architecture q/k rows are permuted into llama.cpp's interleaved order, so reading the
file back exercises the reverse permutation. Tensors are stored as F32 (exact) except those listed in
`quantize`, stored in the given type.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.numpy import load_file

_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
# llama.cpp's Gemma 3 names for the sandwich norms
_GEMMA3 = {**_BLOCK, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
           "post_feedforward_layernorm": "post_ffw_norm"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{(_GEMMA3 if arch == 'gemma3' else _BLOCK)[module]}.{kind}"


def llama3_rope_freqs(theta: float, head_dim: int, scaling: dict[str, float]) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors (rope_freqs for llama3 scaling)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _arch_keys(w: gguf.GGUFWriter, cfg: dict[str, Any], arch: str) -> np.ndarray | None:
    """The keys beyond Llama's a Llama 3 / Qwen3 / Mistral / Gemma 3 config needs; returns rope_freqs or None."""
    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma3":
        rope = rope["full_attention"]
        types = cfg["layer_types"]
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
        if cfg.get("final_logit_softcapping") is not None:
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    elif cfg.get("sliding_window"):  # Mistral: every layer
        w.add_sliding_window(cfg["sliding_window"])
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "llama3":
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return llama3_rope_freqs(rope["rope_theta"], head_dim, rope)
    return None


def write_tiny_gguf(
    hf_folder: str,
    out_path: str,
    arch_name: str | None = None,
    quantize: dict[str, gguf.GGMLQuantizationType] | None = None,
    pre: str = "smollm",
) -> str:
    """Convert `hf_folder` (made by make_tiny_llama) to a GGUF at out_path; returns out_path."""
    folder = Path(hf_folder)
    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    arch = arch_name or cfg["model_type"]
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    w = gguf.GGUFWriter(out_path, arch)
    w.add_name(folder.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    rope_freqs = _arch_keys(w, cfg, arch)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])

    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([int(gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL) for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template((folder / "chat_template.jinja").read_text())

    weights = load_file(str(folder / "model.safetensors"))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    for hf_name in sorted(weights):
        data = weights[hf_name].astype(np.float32)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # llama.cpp's converter stores Gemma's norms with their 1 added
        if arch == "llama" and ".q_proj." in hf_name:
            data = llama_cpp_permute(data, n_head)
        elif arch == "llama" and ".k_proj." in hf_name:
            data = llama_cpp_permute(data, n_kv)
        name = gguf_name(hf_name, arch)
        qtype = (quantize or {}).get(hf_name)
        if qtype is None:
            w.add_tensor(name, data)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:  # packed blocks: the writer derives the element shape from the byte shape
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path

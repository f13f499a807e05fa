"""Writing a tiny HF folder (see tiny_models.py) out as a GGUF, the way llama.cpp's converter does.

For the llama architecture q/k rows are permuted into llama.cpp's interleaved order, so reading the
file back exercises the reverse permutation. Tensors are stored as F32 (exact) except those listed in
`quantize`, stored in the given type.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
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
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK[module]}.{kind}"


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
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
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
    for hf_name in sorted(weights):
        data = weights[hf_name].astype(np.float32)
        if arch == "llama" and ".q_proj." in hf_name:
            data = llama_cpp_permute(data, n_head)
        elif arch == "llama" and ".k_proj." in hf_name:
            data = llama_cpp_permute(data, n_kv)
        name = gguf_name(hf_name)
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

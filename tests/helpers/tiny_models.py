"""Tiny random Hugging Face Llama / Qwen2 folders for fast, exact comparisons with transformers.

`make_tiny_llama(tmp_dir, family, tie)` saves a seeded 2-layer model (safetensors), config.json,
generation_config.json and a small byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json,
chat template), then returns the folder. Load it with kvseal's `load_hf_folder` or transformers'
`AutoModelForCausalLM.from_pretrained(folder)` / `AutoTokenizer.from_pretrained(folder)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

TINY_FAMILIES = ("llama", "qwen2")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2, as in SmolLM2
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# transformers 5 rebuilds a qwen2 folder's tokenizer as Qwen2Tokenizer (NFC + this split regex) whatever
# tokenizer.json says, so the tiny qwen2 tokenizer is built that way for both libraries to agree.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# A few fixed merges so the BPE does real work; each merge's result joins the vocabulary in order.
_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"),
           ("e", "s"), ("Ġ", "w"), ("o", "r"), ("l", "l"), ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("Ġ", "1")]


def _byte_alphabet() -> list[str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def build_tiny_tokenizer(family: str = "llama") -> Tokenizer:
    """A byte-level BPE tokenizer: 3 special tokens, 256 byte tokens, then one token per merge."""
    vocab: dict[str, int] = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in _byte_alphabet():
        vocab[ch] = len(vocab)
    for a, b in _MERGES:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(_MERGES), fuse_unk=False))
    if family == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS])
    return tok


def _save_tokenizer(folder: Path, family: str) -> int:
    from transformers import PreTrainedTokenizerFast

    backend = build_tiny_tokenizer(family)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
        chat_template=CHATML_TEMPLATE,
    )
    hf_tok.save_pretrained(str(folder))
    return int(backend.get_vocab_size(with_added_tokens=True))


def make_tiny_llama(tmp_dir: str | Path, family: str, tie: bool, seed: int = 0) -> str:
    """Save a seeded tiny `family` ("llama" | "qwen2") model + tokenizer under tmp_dir; return the folder."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if family not in TINY_FAMILIES:
        raise ValueError(f"family must be one of {TINY_FAMILIES}, got {family!r}")
    folder = Path(tmp_dir) / f"tiny-{family}-{'tied' if tie else 'untied'}"
    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = _save_tokenizer(folder, family)
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    config: Any
    model_cls: Any
    if family == "llama":
        config, model_cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        config, model_cls = Qwen2Config(**common), Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        # Random init leaves norms at 1 and biases at 0; perturb them so a wrong mapping cannot pass.
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(folder))
    return str(folder)


# The families of issue 18 beyond Llama/Qwen2, each with what makes it differ switched on in a tiny model.
TINY_ARCHS = ("llama3", "qwen3", "mistral", "gemma3")
TINY_WINDOW = 16  # Mistral's and Gemma 3's sliding window in the tiny models: prompts in the tests run past it
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def make_tiny_arch(tmp_dir: str | Path, kind: str, seed: int = 0, tie: bool | None = None, **overrides: Any) -> str:
    """Save a seeded tiny `kind` (TINY_ARCHS) model + tokenizer under tmp_dir; return the folder.

    llama3: rope_scaling llama3 (theta 5e5, head_dim 16: high, medium and low frequency bands all present);
    qwen3: q/k norms, head_dim 32 (not hidden / heads), no biases; mistral: sliding_window TINY_WINDOW on every
    layer; gemma3: local (window TINY_WINDOW, rope base 1e4) and global (rope 1e6, linear scaling 2) layers,
    query_pre_attn_scalar 24, GeGLU, sandwich norms, scaled embeddings, final logit softcap 5.
    tie: None ties the embeddings except for gemma3, whose tiny model, tied, only ever repeats the last token (its
    scaled embedding outweighs two layers); the real Gemma 3 270M test covers its tied head.
    overrides: config fields to set instead (e.g. query_pre_attn_scalar=16: a GGUF states none, llama.cpp takes
    head_dim)."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    if kind not in TINY_ARCHS:
        raise ValueError(f"kind must be one of {TINY_ARCHS}, got {kind!r}")
    tie = kind != "gemma3" if tie is None else tie
    folder = Path(tmp_dir) / f"tiny-{kind}-{'tied' if tie else 'untied'}{'-'.join(['', *overrides])}"
    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = _save_tokenizer(folder, "qwen2" if kind == "qwen3" else "llama")
    common: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
        # weights 10x transformers' default: the layers, not the embeddings alone, decide the greedy token (with
        # 0.02 removing the window or the q/k norms leaves every argmax as it was)
        "initializer_range": 0.2,
    }
    config: Any
    model_cls: Any
    if kind == "llama3":
        config = LlamaConfig(**{**common, "max_position_embeddings": 16384},
                             rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE})
        model_cls = LlamaForCausalLM
    elif kind == "qwen3":
        config, model_cls = Qwen3Config(**common, head_dim=32, rope_theta=1e6), Qwen3ForCausalLM
    elif kind == "mistral":
        config, model_cls = MistralConfig(**common, sliding_window=TINY_WINDOW), MistralForCausalLM
    else:
        config = Gemma3TextConfig(
            **{**common, "num_hidden_layers": 4}, head_dim=16, sliding_window=TINY_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
            **{"query_pre_attn_scalar": 24, "final_logit_softcapping": 5.0, **overrides})
        model_cls = Gemma3ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):  # norms start at 1 (Gemma: 0): perturb them
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(folder))
    return str(folder)


def hf_greedy(folder: str, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' fp32 greedy ids for each prompt, recomputing the whole sequence each step (no KV cache)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            seq = list(ids)
            for _ in range(new):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(ids):])
    return out

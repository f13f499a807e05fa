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

"""A sentence-transformers folder as kvseal reads it, without its weights (no torch: the router tokenizes with it):
the BERT encoder's shape, its tokenizer, and the pooling and normalization its modules.json, 1_Pooling/config.json
and sentence_bert_config.json name (embed/checkpoint.py computes them).

Read from the checkpoint, never guessed: a folder without modules.json, or with a module kvseal does not have (a
Dense projection, a second pooling mode), is refused with what it holds and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from kvseal.model.bert_arch import BertArch

POOLINGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
            "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len", "pooling_mode_lasttoken": "last"}
_TRANSFORMER, _POOLING, _NORMALIZE = (f"sentence_transformers.models.{m}" for m in ("Transformer", "Pooling",
                                                                                      "Normalize"))


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path} ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True)
class Pipeline:
    """What sentence-transformers does after the encoder, and the longest input it takes."""

    pooling: str  # a value of POOLINGS
    normalize: bool
    max_tokens: int  # sentence_bert_config's max_seq_length (capped by the model's positions), [CLS] and [SEP] in

    @classmethod
    def read(cls, folder: Path, max_position: int) -> Pipeline:
        modules = folder / "modules.json"
        if not modules.is_file():
            raise ValueError(f"{folder} has no modules.json: kvseal reads an embedding model's pooling from its "
                             f"sentence-transformers config; serve a sentence-transformers folder")
        listed = _json(modules)
        kinds = [m.get("type") for m in listed]
        pools = [m for m in listed if m.get("type") == _POOLING]
        extra = [k for k in kinds if k not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
        if kinds[:1] != [_TRANSFORMER] or len(pools) != 1 or extra:
            raise ValueError(f"{modules}: modules {kinds}; kvseal embeds with Transformer, Pooling and an optional "
                             f"Normalize, nothing else")
        cfg = _json(folder / pools[0].get("path", "1_Pooling") / "config.json")
        modes = [name for key, name in POOLINGS.items() if cfg.get(key)]
        others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in POOLINGS]
        if len(modes) != 1 or others:
            raise ValueError(f"{folder}: pooling {modes + others}; kvseal pools with exactly one of "
                             f"{', '.join(POOLINGS.values())}")
        st = folder / "sentence_bert_config.json"
        max_seq = int(_json(st).get("max_seq_length") or max_position) if st.is_file() else max_position
        return cls(modes[0], _NORMALIZE in kinds, min(max_seq, max_position))


class EmbedFolder:
    """What the router needs of the model (no weights): its name, shape, pipeline and tokenizer."""

    def __init__(self, path: str) -> None:
        folder = Path(path)
        if not folder.is_dir():
            raise ValueError(f"invalid --embed-model={path!r}: not a folder; give a sentence-transformers folder "
                             f"(config.json, model.safetensors, tokenizer.json, modules.json)")
        self.folder, self.name = folder, folder.name
        self.arch = BertArch.from_hf_config(_json(folder / "config.json"), str(folder))
        self.pipeline = Pipeline.read(folder, self.arch.max_position)
        self.tokenizer = load_tokenizer(folder)

    @property
    def dim(self) -> int:
        return self.arch.hidden_size


def load_tokenizer(folder: Path) -> tokenizers.Tokenizer:
    """tokenizer.json with its post-processor ([CLS] ... [SEP]) and without its truncation and padding: an input
    over the model's length is refused by the API, never cut silently, and inputs are packed, never padded."""
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok

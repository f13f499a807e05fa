"""The tokenizer a checkpoint brings: ids <-> text, and its chat template.

Built either from a GGUF file's `tokenizer.ggml.*` metadata (see `gguf_tokenizer.py`) or from a
Hugging Face folder's tokenizer.json + tokenizer_config.json. Encoding never relies on the backend's
post-processor: BOS is prepended here, exactly when `add_bos` says so.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers

from kvseal.model.chat_template import compile_chat_template, normalize_messages, render_chat_template
from kvseal.model.detokenize import IncrementalDecoder
from kvseal.model.token_bound import longest_token_bytes

if TYPE_CHECKING:
    import jinja2


__all__ = ["IncrementalDecoder", "Tokenizer"]


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token facts the engine needs."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_id: int | None,
        eos_ids: tuple[int, ...],
        add_bos: bool,
        chat_template: str | None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        vocab_size = backend.get_vocab_size(with_added_tokens=True)
        for what, tid in [("bos_id", bos_id), *(("eos_ids", e) for e in eos_ids)]:
            if tid is not None and not 0 <= tid < vocab_size:
                raise ValueError(f"Tokenizer {what} contains {tid}, outside the vocabulary [0, {vocab_size})")
        if add_bos and bos_id is None:
            raise ValueError("Tokenizer add_bos=True needs a bos_id; pass bos_id or set add_bos=False")
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template
        # Template variables, as transformers passes its special_tokens_map.
        self.bos_token = bos_token if bos_token is not None else self._token_or_none(bos_id)
        self.eos_token = eos_token if eos_token is not None else self._token_or_none(
            eos_ids[0] if eos_ids else None
        )
        self._compiled: jinja2.Template | None = None

    def _token_or_none(self, tid: int | None) -> str | None:
        return None if tid is None else self.backend.id_to_token(tid)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            assert self.bos_id is not None  # checked in __init__
            return [self.bos_id, *ids]
        return list(ids)

    @cached_property
    def longest_token_bytes(self) -> int | None:
        """Bytes of text one token stands for at most (None: no such bound for this tokenizer)."""
        return longest_token_bytes(self.backend)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        tid = self.backend.token_to_id(token)
        return None if tid is None else int(tid)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text for a conversation, rendered with the model's own template."""
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat_template (neither tokenizer.chat_template in the GGUF nor "
                "chat_template in tokenizer_config.json / chat_template.jinja); send a plain prompt instead"
            )
        normalized = normalize_messages(messages)
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        specials = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token)) if v}
        return render_chat_template(self._compiled, normalized, add_generation_prompt, specials, tools)

    def with_chat_template(self, source: str, origin: str = "--chat-template") -> Tokenizer:
        """The same tokenizer rendering chats with `source` instead of the model's own template (vLLM's
        --chat-template). A template that does not parse is refused here, at start, naming `origin`."""
        try:
            compiled = compile_chat_template(source)
        except ValueError as exc:
            raise ValueError(f"invalid {origin}: {exc}; fix the template or leave the flag out") from None
        tok = Tokenizer(self.backend, self.bos_id, self.eos_ids, self.add_bos, source, self.bos_token,
                        self.eos_token)
        tok._compiled = compiled
        return tok

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        return tokenizer_from_hf_folder(path)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")  # noqa: TRY004
    return data


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as a serialized AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_of(folder: Path, cfg: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"  # transformers >= 4.50 saves the template here
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def tokenizer_from_hf_folder(path: str | Path) -> Tokenizer:
    """Build a Tokenizer from tokenizer.json, tokenizer_config.json and the eos ids of the model configs."""
    folder = Path(path)
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise ValueError(
            f"{folder} has no tokenizer.json; only fast (tokenizers) tokenizers are supported. "
            "Re-save the tokenizer with transformers' save_pretrained to produce one."
        )
    backend = tokenizers.Tokenizer.from_file(str(tok_file))
    cfg = _read_json(folder / "tokenizer_config.json")
    model_cfg = _read_json(folder / "config.json")
    gen_cfg = _read_json(folder / "generation_config.json")

    bos_token = _token_content(cfg.get("bos_token"))
    eos_token = _token_content(cfg.get("eos_token"))
    bos_id = backend.token_to_id(bos_token) if bos_token else None
    if bos_id is None:
        bos_ids = _as_id_list(gen_cfg.get("bos_token_id", model_cfg.get("bos_token_id")))
        bos_id = bos_ids[0] if bos_ids else None

    # eos: the tokenizer's own eos first, then every id the generation/model config lists.
    eos: list[int] = []
    tok_eos = backend.token_to_id(eos_token) if eos_token else None
    config_eos = _as_id_list(gen_cfg.get("eos_token_id", model_cfg.get("eos_token_id")))
    for tid in ([tok_eos] if tok_eos is not None else []) + config_eos:
        if tid not in eos:
            eos.append(tid)

    add_bos = cfg.get("add_bos_token")
    if add_bos is None:
        # No flag: whatever the tokenizer.json post-processor does decides, as it does in transformers.
        probe = backend.encode("", add_special_tokens=True).ids
        add_bos = bool(probe) and bos_id is not None and probe[0] == bos_id
    return Tokenizer(
        backend,
        bos_id=bos_id,
        eos_ids=tuple(eos),
        add_bos=bool(add_bos),
        chat_template=_chat_template_of(folder, cfg),
        bos_token=bos_token,
        eos_token=eos_token,
    )

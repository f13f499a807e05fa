"""A lower bound on a text's token count from its UTF-8 length, known before tokenizing it.

No token of a vocabulary stands for more than `longest` bytes of text, so a text of n bytes needs at least
ceil(n / longest) tokens: a prompt that cannot fit the window is refused from its length, without the seconds a
multi-megabyte tokenization costs (seal 11: that time is shared). The bound holds only when what comes between the
text and the vocabulary shrinks the text by a known factor at most: normalizers that only add (Prepend, Replace
with a longer string) by none, NFC by 3 (three Hangul jamo of 3 bytes compose to one syllable of 3; no other
composition shrinks more). A tokenizer whose normalizer, pre-tokenizer or model may drop or fuse characters
(NFKC, Lowercase, Strip, a Split that removes, fused unknowns) gets no bound (None) and is always tokenized in full.

`longest` is measured on the vocabulary's own spellings, which are never shorter than the text they stand for:
a ByteLevel token spells each byte as one character; a SentencePiece token spells a space as "▁" (3 bytes) and a
byte-fallback token as "<0xNN>" (6).
"""

from __future__ import annotations

import json
from typing import Any

import tokenizers

_SHRINKS_AT_MOST = {"Prepend": 1, "NFC": 3}  # normalizer -> the most it can shrink a text's UTF-8 by
_KEEPS_ALL_PRETOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}


def longest_token_bytes(backend: tokenizers.Tokenizer) -> int | None:
    """Bytes of text the longest token stands for at most; None when the text may shrink before the vocabulary."""
    normalizer, pre = _spec(backend.normalizer), _spec(backend.pre_tokenizer)
    shrink = _shrinks_at_most(normalizer)
    if shrink is None or not (_keeps_all(pre) and _no_fused_unknowns(backend.model)):
        return None
    byte_level = _has(pre, "ByteLevel")
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    longest = 1
    for token in backend.get_vocab(with_added_tokens=True):
        n = len(token) if byte_level and token not in added else len(token.encode("utf-8", "surrogatepass"))
        longest = max(longest, n)
    return longest * shrink


def min_tokens(text_bytes: int, longest: int | None) -> int:
    """At least this many tokens for a text of `text_bytes` UTF-8 bytes (0: no bound known)."""
    return 0 if longest is None else -(-text_bytes // longest)


def _spec(part: Any) -> Any:
    """A normalizer's or pre-tokenizer's JSON form (None: there is none). Not the whole tokenizer's: its
    to_str() serializes every merge (1 s for a 150k vocabulary)."""
    return None if part is None else json.loads(part.__getstate__())


def _shrinks_at_most(node: Any) -> int | None:
    """The most a normalizer can divide a text's UTF-8 length by (None: unknown, or without bound)."""
    if node is None:
        return 1
    kind = node.get("type")
    if kind == "Sequence":
        factor = 1
        for n in node.get("normalizers", []):
            f = _shrinks_at_most(n)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":
        pattern = (node.get("pattern") or {}).get("String")
        content = node.get("content", "")
        return 1 if isinstance(pattern, str) and len(content.encode()) >= len(pattern.encode()) else None
    return _SHRINKS_AT_MOST.get(kind)


def _keeps_all(node: Any) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_keeps_all(n) for n in node.get("pretokenizers", []))
    if kind == "Split" and node.get("behavior") == "Removed":
        return False
    return kind in _KEEPS_ALL_PRETOKENIZERS


def _no_fused_unknowns(model: Any) -> bool:
    """BPE only: an unknown run fused into one <unk> would stand for any number of bytes."""
    return isinstance(model, tokenizers.models.BPE) and (bool(model.byte_fallback) or not model.fuse_unk)


def _has(node: Any, kind: str) -> bool:
    if node is None:
        return False
    if node.get("type") == "Sequence":
        return any(_has(n, kind) for n in node.get("pretokenizers", []))
    return bool(node.get("type") == kind)

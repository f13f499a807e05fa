"""Streaming detokenization: turn generated token ids into text one token at a time.

A byte-level BPE token can end in the middle of a multi-byte UTF-8 character (an emoji is often
split over two or three tokens). Decoding such a prefix yields U+FFFD, so text ending in U+FFFD is
held back until the character completes. Only a short window of recent ids is decoded per token
(the prefix/read offsets of vLLM's detokenizer), so the cost per token does not grow with the
length of the sequence.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class _Decodes(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDecoder:
    """Emits only newly stable text for each fed token; `flush()` returns whatever was held back.

    Invariants (indices into self._ids, which holds only the live window):
      0 <= self._read <= len(self._ids)
      self._ids[:self._read] decodes to self._prefix_text, which was already emitted and ends on a
      character boundary; the text of self._ids[self._read:] has not been emitted yet.
    The concatenation of every feed() result and flush() equals tokenizer.decode(all ids).
    """

    def __init__(self, tokenizer: _Decodes, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._read = 0
        self._prefix_text = ""

    def feed(self, token_id: int) -> str:
        """Add one token id; return the text that became stable because of it (maybe "")."""
        self._ids.append(int(token_id))
        text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            # Nothing new yet, or a multi-byte character is still incomplete: hold it back.
            return ""
        new_text = text[len(self._prefix_text) :]
        # Slide the window: the ids just emitted become the decoding context for the next token.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._prefix_text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        return new_text

    def flush(self) -> str:
        """Return the held-back text (possibly ending in U+FFFD) and reset the decoder."""
        text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        rest = text[len(self._prefix_text) :]
        self._ids = []
        self._read = 0
        self._prefix_text = ""
        return rest

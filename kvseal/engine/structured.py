"""Structured output (`response_format`): constrained decoding with xgrammar, as vLLM and SGLang do it.

Before each sampling step the logits of a constrained row are masked to the tokens its grammar allows next (a
packed bitmask, (B, ceil(V/32)) int32), so greedy or sampled, every token keeps the output a valid prefix of the
grammar; once the grammar is complete only a stop token is allowed and the request ends FINISHED(stop).
Grammars are compiled once per distinct format (an LRU of compiled grammars); each sequence holds its own
matcher. xgrammar is imported on the first constrained request, so a server that never sees one never pays it.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from kvseal.engine.messages import ResponseFormat
from kvseal.errors import InvalidRequest
from kvseal.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch
    import xgrammar


class Grammars:
    """Compiles response formats for one tokenizer and vocabulary width (the logits' V)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compile = lru_cache(maxsize=64)(self._compile_uncached)

    def compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            import xgrammar as xgr

            backend = self.tokenizer.backend
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
            vocab = [""] * self.vocab_size
            for text, tid in backend.get_vocab(with_added_tokens=True).items():
                if tid < self.vocab_size:
                    vocab[tid] = text
            info = xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=self.vocab_size,
                                     stop_token_ids=list(self.tokenizer.eos_ids),
                                     add_prefix_space=meta["add_prefix_space"])
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def _compile_uncached(self, fmt: ResponseFormat) -> xgrammar.CompiledGrammar:
        compiler = self.compiler()
        if fmt.type == "json_object":  # OpenAI's json_object is an object, not any JSON value
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if fmt.type == "json_schema" and fmt.schema is not None:
            try:
                return compiler.compile_json_schema(fmt.schema, any_whitespace=False)
            except Exception as exc:  # noqa: BLE001 (xgrammar's errors are untyped; a peer's schema is untrusted)
                why = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc)).strip()  # less xgrammar's source line
                raise InvalidRequest(f"response_format.json_schema.schema is not a JSON schema kvseal can "
                                     f"enforce: {why}", param="response_format.json_schema.schema") from None
        raise InvalidRequest(f"response_format type {fmt.type!r} needs " +
                             ("a schema" if fmt.type == "json_schema" else "one of json_object or json_schema"),
                             param="response_format")

    def check(self, fmt: ResponseFormat) -> None:
        """Raise InvalidRequest, naming the field, when `fmt` cannot be enforced (the router's door)."""
        self._compile(fmt)

    def matcher(self, fmt: ResponseFormat) -> xgrammar.GrammarMatcher:
        """A fresh matcher for one sequence; an unusable format raises InvalidRequest naming it."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self._compile(fmt))

    def mask(self, logits: torch.Tensor, matchers: list[xgrammar.GrammarMatcher | None]) -> None:
        """Mask, in place, the rows of logits (B, V) whose sequence has a matcher to what it allows next."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        import torch
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)  # (R, ceil(V/32)) int32
        for j, i in enumerate(rows):
            m = matchers[i]
            assert m is not None
            m.fill_next_token_bitmask(bitmask, j)
        with torch.inference_mode():  # the runner's logits are an inference tensor
            sub = logits[rows].float()
            xgr.apply_token_bitmask_inplace(sub, bitmask.to(sub.device))
            logits[rows] = sub.to(logits.dtype)


def response_format(kind: str, schema: Any = None) -> ResponseFormat:
    """The wire form of a response format: the schema as compact JSON text (its compile cache key too)."""
    text = None if schema is None else json.dumps(schema, separators=(",", ":"))  # key order is the order enforced
    return ResponseFormat(kind, text)

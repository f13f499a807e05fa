"""Prompt text -> token ids, for one request: on its tenant's turn of the text pool, refused early when too long.

Rendering a chat template and tokenizing run on the TextPool's threads (tenancy/textpool.py: a fair queue per tenant
and a cap per tenant, so one tenant's huge prompts cannot hold up another's), never on the event loop. The
tokenizer is called through `encode_batch`, which releases the GIL (its `encode` holds it: 8 MB of text kept every
other request, the heartbeats and the delta readers waiting for several seconds).

A text whose UTF-8 length alone proves it cannot fit the window is refused before it is tokenized
(model/token_bound.py): no multi-second tokenization happens for a prompt that would be refused anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvseal.errors import ContextLengthExceeded, InvalidRequest
from kvseal.model.token_bound import min_tokens
from kvseal.model.tokenizer import Tokenizer
from kvseal.tenancy.textpool import TextPool


def encode(tok: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """The same ids as tok.encode(text, add_special_tokens), without holding the GIL while tokenizing."""
    ids = list(tok.backend.encode_batch([text], add_special_tokens=False)[0].ids)
    if add_special_tokens and tok.add_bos:
        assert tok.bos_id is not None  # the Tokenizer checks this at construction
        return [tok.bos_id, *ids]
    return ids


@dataclass(frozen=True)
class PromptText:
    """What one request needs to turn its text into ids: the tokenizer, the pool and its tenant's place in it,
    and the served window."""

    tok: Tokenizer
    pool: TextPool
    tenant: str
    window: int

    async def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     tools: list[dict[str, Any]] | None = None) -> str:
        return await self.pool.run(self.tenant, self.tok.apply_chat_template, messages, add_generation_prompt, tools)

    async def encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text` (a rendered chat: param "messages", add_special_tokens False; a prompt: "prompt")."""
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"the {param} are not valid UTF-8 text (a lone surrogate at position {exc.start})",
                                 param=param) from None
        at_least = min_tokens(size, self.tok.longest_token_bytes)
        if at_least > self.window:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.window} tokens. However, your {param} would be at "
                f"least {at_least} tokens ({size} bytes of text, and no token of this model stands for more than "
                f"{self.tok.longest_token_bytes} bytes). Please reduce the length of the {param}.", param=param)
        return await self.pool.run(self.tenant, encode, self.tok, text, add_special_tokens)

"""Prompt text -> token ids, off the router's event loop.

Rendering a chat template and tokenizing run in a worker thread, and the tokenizer is called through
`encode_batch`, which releases the GIL (its `encode` holds it: 8 MB of text kept every other request, the
heartbeats and the delta readers waiting for several seconds). So a huge prompt costs its own latency only.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvseal.model.tokenizer import Tokenizer


def encode(tok: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """The same ids as tok.encode(text, add_special_tokens), without holding the GIL while tokenizing."""
    ids = list(tok.backend.encode_batch([text], add_special_tokens=False)[0].ids)
    if add_special_tokens and tok.add_bos:
        assert tok.bos_id is not None  # the Tokenizer checks this at construction
        return [tok.bos_id, *ids]
    return ids


async def encode_text(tok: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return await asyncio.to_thread(encode, tok, text, add_special_tokens)


async def render_chat(tok: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                      tools: list[dict[str, Any]] | None = None) -> str:
    return await asyncio.to_thread(tok.apply_chat_template, messages, add_generation_prompt, tools)

"""Prompt-lookup drafts: a request's next tokens guessed from its own text, and nothing else (issue 33).

A request that rewrites code it was given repeats long runs of its prompt. When its last few tokens occurred
before in its own prompt or output, the tokens that followed them then are a good guess for what comes now: those
are the draft, verified by the model in the next step (engine/speculate.py).

Isolation (seal 11): a `Lookup` belongs to one request and is fed only that request's tokens; there is no table
shared between requests, tenants or engines (llama.cpp's `ngram-mod` keeps one pool for every slot: what one
request drafts, and so how fast it streams, then depends on other users' text). `drafts_from(tokens)` rebuilds a
request's drafts from its text alone, which is how the tests check that nothing else reached them.

Invariant: positions[n][gram] is the last position p (p + n <= len(tokens)) such that tokens[p:p + n] == gram and
p + n < len(tokens), i.e. an occurrence that something followed.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 4  # the longest suffix looked up first
MIN_NGRAM = 2  # a single repeated token is too weak a signal to spend a step on


class Lookup:
    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self.positions: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens of this request (its prompt, then each accepted token)."""
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens) - 1  # the new token's position: the grams ending just before it were followed
            for n in range(1, self.max_ngram + 1):
                start = end - n
                if start >= 0:
                    self.positions[n][tuple(self.tokens[start:end])] = start

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of this request's last tokens ([] if none)."""
        if k <= 0:
            return []
        toks = self.tokens
        for n in range(min(self.max_ngram, len(toks) - 1), self.min_ngram - 1, -1):
            at = self.positions[n].get(tuple(toks[len(toks) - n:]))
            if at is not None:
                follow = at + n
                return toks[follow:follow + k]
        return []


def drafts_from(tokens: Sequence[int], prompt_len: int, k: int) -> list[list[int]]:
    """The drafts a request with this text would be offered at each output position, rebuilt from its text alone:
    draft i is what Lookup offers after the prompt and the first i output tokens."""
    lookup = Lookup()
    lookup.extend(tokens[:prompt_len])
    out = []
    for i in range(prompt_len, len(tokens) + 1):
        out.append(lookup.draft(k))
        if i < len(tokens):
            lookup.extend(tokens[i:i + 1])
    return out

"""Verifying a draft, and how long the next one may be (issue 33).

A step feeds a request its last token and its draft d1..dk; the model's logits at those k + 1 positions give a
target distribution p_0..p_k (p_j: for the token after d_j, p_0 after the last real token).

- Greedy: d_j is accepted while it equals argmax p_{j-1}; the first mismatch is replaced by that argmax, and if all
  k are accepted argmax p_k comes as a bonus. The tokens are exactly the ones decoding one at a time would give.
- Sampled (standard speculative sampling, Leviathan et al. 2023, with a draft that is a point mass q = 1 at d_j):
  d_j is accepted with probability p_{j-1}(d_j); on rejection the token is drawn from p_{j-1} with d_j removed and
  renormalized (the residual max(p - q, 0)), and after k acceptances one more token is drawn from p_k. Each token's
  distribution is exactly p's: the output distribution is that of decoding without a draft.

Each draw of token `index` uses the request's generator for that index (wire/seeds.draw_seed), so a seeded
request is reproducible, with or without other requests beside it.

The draft length adapts per request (DraftLength): it grows while drafts are accepted whole, shrinks when they
fail, and a request whose drafts keep failing stops drafting (and tries again, shorter, after a pause).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvseal.engine.lookup import Lookup

MAX_DRAFT = 8
PAUSE_TOKENS = 32  # after FAILS_TO_PAUSE drafts in a row accepted nowhere, this many tokens without one
FAILS_TO_PAUSE = 3


@dataclass
class DraftLength:
    """One request's draft length. `emitted` counts the request's output tokens (a pause is measured in them)."""

    k: int = 4
    fails: int = 0  # drafts in a row of which nothing was accepted
    paused_until: int = 0  # no draft before the request has emitted this many tokens
    drafted: int = 0
    accepted: int = 0

    def want(self, emitted: int) -> int:
        """How many draft tokens to ask for now (0: none this step)."""
        return 0 if emitted < self.paused_until else self.k

    def after(self, drafted: int, accepted: int, emitted: int) -> None:
        """A step verified `drafted` tokens (> 0) of which `accepted` were kept; the request has `emitted` now."""
        self.drafted += drafted
        self.accepted += accepted
        if accepted == drafted:
            self.k, self.fails = min(MAX_DRAFT, self.k + 1), 0
        elif accepted == 0:
            self.k, self.fails = max(1, self.k // 2), self.fails + 1
            if self.fails >= FAILS_TO_PAUSE:
                self.paused_until, self.fails = emitted + PAUSE_TOKENS, 0
        else:
            self.k, self.fails = max(1, accepted + 1), 0


@dataclass
class Speculation:
    """One request's own (Sequence.spec): the index of its text so far, and its draft length."""

    lookup: Lookup = field(default_factory=Lookup)
    length: DraftLength = field(default_factory=DraftLength)

    def catch_up(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Index the tokens the request has taken in since the last step (its prompt, the first time)."""
        have, p = len(self.lookup.tokens), len(prompt_ids)
        if have < p:
            self.lookup.extend(prompt_ids[have:])
            have = p
        self.lookup.extend(output_ids[have - p:])


def verify_greedy(draft: list[int], logits: torch.Tensor) -> list[int]:
    """logits: (k + 1, V) at the last token and each draft token. The tokens to emit: the accepted prefix of the
    draft and the model's own next token (at least one token, at most k + 1)."""
    best = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for j, d in enumerate(draft):
        if d != best[j]:
            break
        out.append(d)
    out.append(int(best[len(out)]))
    return out


def verify_sampled(draft: list[int], probs: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
    """probs: (k + 1, V) the target distributions (temperature, top-k and top-p already applied); generators[j]:
    the generator of the j-th token this step may emit. The tokens to emit (at least one, at most k + 1)."""
    out: list[int] = []
    for j, d in enumerate(draft):
        p = probs[j]
        u = torch.rand((), generator=generators[j])
        if float(u) < float(p[d]):
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        total = float(residual.sum())
        if total <= 0.0:  # p was a point mass on d: u < p[d] = 1 always accepts; float slack only
            out.append(d)
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=generators[j]).item()))
        return out
    k = len(draft)
    out.append(int(torch.multinomial(probs[k], 1, generator=generators[k]).item()))
    return out

"""Turn logits into tokens: greedy, temperature, top-k, top-p, per-request seeded generators, logprobs."""

from __future__ import annotations

import torch

from kvseal.engine.messages import SamplingParams, TokenLogprob


def sample(
    logits: torch.Tensor,  # (B, V) float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row. Greedy rows take the argmax; the others sample with their own generator, so a
    seeded request draws the same tokens whatever else shares its batch."""
    tokens: list[int] = [0] * logits.shape[0]
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if greedy_rows:
        picks = logits[greedy_rows].argmax(dim=-1).tolist()
        for i, t in zip(greedy_rows, picks):
            tokens[i] = t
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least the best token)
            drop = (sorted_p.cumsum(0) - sorted_p) >= p.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())

    logprobs: list[TokenLogprob | None] = [None] * len(params)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        lp = torch.log_softmax(logits[want], dim=-1)  # logprobs of the model's raw distribution
        for j, i in enumerate(want):
            k = params[i].logprobs or 0
            top: list[tuple[int, float]] = []
            if k > 0:
                vals, ids = lp[j].topk(k)
                top = list(zip(ids.tolist(), vals.tolist()))
            logprobs[i] = TokenLogprob(tokens[i], float(lp[j, tokens[i]]), top)
    return tokens, logprobs

"""Turn logits into tokens: greedy, temperature, top-k, top-p, per-request seeded generators, logprobs."""

from __future__ import annotations

import torch

from kvseal.wire.messages import SamplingParams, TokenLogprob
from kvseal.wire.seeds import draw_seed

# the least logprob reported: a token the model gives (nearly) no mass still gets a finite number, never the
# -Infinity that JSON cannot carry and that a peer's manifest check refuses
LOGPROB_FLOOR = -9999.0


def sample(
    logits: torch.Tensor,  # (B, V) float32
    params: list[SamplingParams],
    seeds: list[int],  # per row: the request's seed (ignored for greedy rows)
    indices: list[int],  # per row: how many tokens the request has already generated
    raw: torch.Tensor | None = None,  # (B, V): the model's logits before any grammar mask, for logprobs
) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row. Greedy rows take the argmax; the others draw from a generator seeded by
    draw_seed(seed, index). Logprobs (and the top k) come from `raw` (default: logits), at least LOGPROB_FLOOR."""
    tokens: list[int] = [0] * logits.shape[0]
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if greedy_rows:
        picks = logits[greedy_rows].argmax(dim=-1).tolist()
        for i, t in zip(greedy_rows, picks):
            tokens[i] = t
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = target_probs(logits[i], p)
        tokens[i] = int(torch.multinomial(probs.cpu(), 1, generator=token_generator(seeds[i], indices[i])).item())

    logprobs: list[TokenLogprob | None] = [None] * len(params)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        src = logits if raw is None else raw
        lp = torch.log_softmax(src[want].float(), dim=-1).clamp_(min=LOGPROB_FLOOR)  # the model's raw distribution
        for j, i in enumerate(want):
            k = params[i].logprobs or 0
            top: list[tuple[int, float]] = []
            if k > 0:
                vals, ids = lp[j].topk(k)
                top = list(zip(ids.tolist(), vals.tolist()))
            logprobs[i] = TokenLogprob(tokens[i], float(lp[j, tokens[i]]), top)
    return tokens, logprobs


def target_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """(V,) logits -> the distribution a sampled (not greedy) token is drawn from: temperature, top-k, top-p."""
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the best token)
        drop = (sorted_p.cumsum(0) - sorted_p) >= p.top_p
        drop[0] = False  # even a top_p that rounds to 0 in float32 keeps the best token
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return probs


def token_generator(seed: int, index: int) -> torch.Generator:
    """The generator of a request's token number `index`: the same draws whatever runs beside it."""
    return torch.Generator(device="cpu").manual_seed(draw_seed(seed, index))

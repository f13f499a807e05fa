"""Prompt-lookup drafts and their verification (engine/lookup.py, engine/speculate.py): drafts come from the
request's own text alone; greedy verification gives exactly the tokens of one-at-a-time decoding; sampled
verification keeps the target distribution (fixed-seed chi-square against plain sampling); the draft length adapts.
"""

from __future__ import annotations

import random

import torch

from kvseal.engine.lookup import Lookup, drafts_from
from kvseal.engine.speculate import FAILS_TO_PAUSE, MAX_DRAFT, PAUSE_TOKENS, DraftLength, verify_greedy, verify_sampled

CHI2_DF4_P001 = 18.47  # chi-square, 4 degrees of freedom, p = 0.001


def test_a_draft_is_what_followed_the_longest_earlier_occurrence_of_the_last_tokens() -> None:
    lk = Lookup()
    lk.extend([5, 6, 7, 8, 9, 1, 2, 6, 7, 3, 3, 5, 6, 7])
    assert lk.draft(3) == [8, 9, 1]  # 5 6 7 occurred at the start (the later 6 7 was followed by 3)
    lk.extend([8])
    assert lk.draft(2) == [9, 1]
    assert Lookup().draft(4) == [] and lk.draft(0) == []
    lonely = Lookup()
    lonely.extend([1, 2, 3, 4])
    assert lonely.draft(4) == []  # its last tokens never occurred before: no draft, not itself


def test_drafts_come_from_the_requests_own_text_alone_whatever_else_runs_beside_it() -> None:
    rng = random.Random(0)
    texts = {r: [rng.randrange(8) for _ in range(200)] for r in ("a", "b")}
    lookups = {r: Lookup() for r in texts}
    seen: dict[str, list[list[int]]] = {r: [] for r in texts}
    for r in texts:
        lookups[r].extend(texts[r][:50])
    for i in range(50, 201):  # two requests interleaved, step by step
        for r in ("a", "b"):
            seen[r].append(lookups[r].draft(5))
            if i < 200:
                lookups[r].extend(texts[r][i:i + 1])
    for r, text in texts.items():
        assert seen[r] == drafts_from(text, 50, 5)  # reproduced from its own text alone


def test_greedy_verification_gives_the_tokens_of_one_at_a_time_decoding() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        logits = torch.randn(5, 11, generator=g)
        best = logits.argmax(-1).tolist()
        cut = int(torch.randint(0, 5, (), generator=g))
        draft = best[:cut] + ([(best[cut] + 1) % 11] if cut < 4 else []) + best[cut + 1:4]
        out = verify_greedy(draft[:4], logits)
        accepted = next((j for j, d in enumerate(draft[:4]) if d != best[j]), 4)
        assert out == best[:accepted + 1]  # the accepted drafts, then the model's own token


def _chi2(counts: list[int], expected: list[float]) -> float:
    return sum((c - e) ** 2 / e for c, e in zip(counts, expected, strict=True) if e > 0)


def test_sampled_verification_keeps_the_target_distribution() -> None:
    p = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05], [0.3, 0.05, 0.3, 0.15, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]])
    n = 20000
    first, second_after_draft = [0] * 5, [0] * 5
    plain_first = [0] * 5
    for s in range(n):
        gens = [torch.Generator().manual_seed(s * 3 + j) for j in range(3)]
        out = verify_sampled([1, 2], p, gens)
        first[out[0]] += 1
        if out[0] == 1 and len(out) > 1:
            second_after_draft[out[1]] += 1
        plain_first[int(torch.multinomial(p[0], 1, generator=torch.Generator().manual_seed(10**6 + s)))] += 1
    assert _chi2(first, [n * float(x) for x in p[0]]) < CHI2_DF4_P001, first
    m = sum(second_after_draft)
    assert _chi2(second_after_draft, [m * float(x) for x in p[1]]) < CHI2_DF4_P001, second_after_draft
    # against plain sampling without a draft: a two-sample chi-square on the first token
    two = sum((a - b) ** 2 / (a + b) for a, b in zip(first, plain_first, strict=True) if a + b)
    assert two < CHI2_DF4_P001, (first, plain_first)


def test_a_draft_the_target_is_sure_of_is_always_accepted_and_one_it_rules_out_never() -> None:
    sure = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    gens = [torch.Generator().manual_seed(j) for j in range(3)]
    assert verify_sampled([1, 2], sure, gens) == [1, 2, 0]
    out = verify_sampled([0, 2], sure, [torch.Generator().manual_seed(j) for j in range(3)])
    assert out == [1]  # p(0) = 0: rejected at once, the residual is the point mass on 1


def test_the_draft_length_grows_with_acceptance_shrinks_with_failure_and_pauses() -> None:
    d = DraftLength()
    n = 0
    for _ in range(10):
        k = d.want(n)
        n += k + 1
        d.after(k, k, n)
    assert d.want(n) == MAX_DRAFT
    n += 3
    d.after(MAX_DRAFT, 2, n)
    assert d.want(n) == 3
    for _ in range(FAILS_TO_PAUSE):
        n += 1
        d.after(d.want(n), 0, n)
    assert d.want(n) == 0 and d.want(n + PAUSE_TOKENS - 1) == 0  # drafts that keep failing: none for a while
    assert d.want(n + PAUSE_TOKENS) >= 1 and d.drafted > 0 and 0 < d.accepted < d.drafted

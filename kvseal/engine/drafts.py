"""Speculative decoding by prompt lookup (issue 33): which requests draft in a step, and what their drafts became.

Before a step the engine asks `Drafter.propose` for drafts. A request drafts only from its own text (engine/
lookup.py: its `Speculation` is its own, built from its prompt and output alone; nothing is shared between
requests, tenants or engines), and only when drafting is nearly free: nothing waits, no prompt runs, and the step's
decode rows, drafts included, stay within `speculative_rows`. One or a few decode rows read every weight once, and
so do a dozen; a batch of 32 streams is already compute-bound, and gets no drafts (how the engine decides between
batching and drafting). A draft rides in the same batched step as everyone's tokens: its rows follow its request's
last token (engine/runner.py), in pages the request owns (the scheduler grows them, the runner's seal-5 check
covers every position written, drafts included; a draft that does not fit is dropped, never paid for by anyone
else's pages).

After the step `Drafter.verify` keeps the accepted prefix (engine/speculate.py: greedy, the tokens of one-at-a-time
decoding; sampled, the same distribution) and rolls `num_computed` back to the positions that hold real tokens. The
pages past them hold only rejected drafts' KV: they are scrubbed and freed at once (Scheduler.shrink). Rejected
positions on a kept page stay in the request's own page and are rewritten by its next step before any query reads
them (attention reads positions below the query's own).

Not drafted: a request with `speculative: false`, a response_format (its grammar would have to accept every draft
token), logprobs (reported for one token a step), or sampling with its own seed (its tokens must not depend on what
shares its batch; whether it drafts would).
"""

from __future__ import annotations

from collections.abc import Sized

import torch

from kvseal.config import SchedulerConfig
from kvseal.engine.sampling import target_probs, token_generator
from kvseal.engine.sequence import Sequence
from kvseal.engine.speculate import Speculation, verify_greedy, verify_sampled


class Drafter:
    """The engine's drafting policy and its figures (drafted, accepted: per engine, never per tenant)."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.on = cfg.speculative == "lookup"
        self.rows = cfg.speculative_rows
        self.drafted = 0  # draft tokens verified
        self.accepted = 0  # of them, kept
        self.steps = 0  # requests' steps that verified a draft

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        p = seq.params
        # a seeded sampled request gives the same tokens whatever shares its batch (engine/sampling.py); whether it
        # drafts depends on the batch (the rows), and its draws on its drafts: it never drafts
        return (p.speculative and p.response_format is None and seq.grammar is None and p.logprobs is None
                and (p.greedy or p.seed is None))

    def propose(self, waiting: Sized, running: list[Sequence], context_window: int) -> None:
        """Set this step's drafts (Sequence.draft) on the running, or none (see the module docstring)."""
        if not self.on or len(waiting) or any(s.num_tokens - s.num_computed != 1 for s in running):
            return
        budget = self.rows - len(running)
        for seq in running:
            if budget <= 0:
                return
            if not self.eligible(seq):
                continue
            if seq.spec is None:
                seq.spec = Speculation()
            seq.spec.catch_up(seq.prompt_ids, seq.output_ids)
            # every token a full acceptance emits (drafts and the bonus) within max_tokens and the window
            room = min(seq.params.max_tokens - len(seq.output_ids), context_window - seq.num_tokens) - 1
            k = min(seq.spec.length.want(len(seq.output_ids)), budget, room)
            if k > 0:
                seq.draft = seq.spec.lookup.draft(k)
                budget -= len(seq.draft)

    def verify(self, seq: Sequence, logits: torch.Tensor) -> tuple[list[int], int]:
        """logits: (1 + len(draft), V) at seq's last token and each draft token. Returns the tokens to emit (the
        accepted drafts and one of the model's own) and how many draft positions were rejected; seq's num_computed
        is rolled back past them and its draft cleared."""
        draft, n_out = seq.draft, len(seq.output_ids)
        assert seq.spec is not None and logits.shape[0] == len(draft) + 1
        if seq.params.greedy:
            tokens = verify_greedy(draft, logits)
        else:
            probs = torch.stack([target_probs(row, seq.params) for row in logits])
            tokens = verify_sampled(draft, probs, [token_generator(seq.seed, n_out + j) for j in range(len(draft) + 1)])
        accepted = len(tokens) - 1
        rejected = len(draft) - accepted
        seq.num_computed -= rejected  # pages hold the KV of all_ids[:num_computed]: real tokens only
        seq.draft = []
        seq.spec.length.after(len(draft), accepted, n_out + len(tokens))
        self.drafted += len(draft)
        self.accepted += accepted
        self.steps += 1
        return tokens, rejected

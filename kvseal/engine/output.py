"""A sequence's output: each sampled token taken in (stop tokens, stop strings, length), and the deltas that carry
it out. The text of a delta never contains a stop string, nor the start of one that may still be forming.
"""

from __future__ import annotations

from collections.abc import Collection

import msgspec

from kvseal.engine.sequence import Sequence
from kvseal.lifecycle import FinishReason, State
from kvseal.wire.messages import GenerateDelta, TokenLogprob


def take_token(seq: Sequence, tok: int, lp: TokenLogprob | None, eos_ids: Collection[int],
               context_window: int) -> FinishReason | None:
    """Append tok (its grammar, if any, already accepted it) and say whether seq is done: STOP for a stop token
    (past min_tokens; the end of its grammar), a stop string (cut from the text) or LENGTH; None to go on."""
    p = seq.params
    grammar_done = seq.grammar is not None and seq.grammar.is_terminated()  # tok is a stop token then
    seq.output_ids.append(tok)
    if lp is not None:
        seq.pending_logprobs.append(lp)
    n_out = len(seq.output_ids)
    stop_token = tok in p.stop_token_ids or (not p.ignore_eos and tok in eos_ids)
    if grammar_done or (stop_token and n_out > p.min_tokens):
        return FinishReason.STOP
    seq.text += seq.decoder.feed(tok)
    if p.stop and n_out > p.min_tokens:
        longest = max(len(s) for s in p.stop)
        lo = max(0, seq.sent_chars - longest)
        hits = [i for i in (seq.text.find(s, lo) for s in p.stop) if i >= 0]
        if hits:
            seq.text = seq.text[: min(hits)]
            return FinishReason.STOP
    if n_out >= p.max_tokens or seq.num_tokens >= context_window:
        seq.text += seq.decoder.flush()
        return FinishReason.LENGTH
    return None


def next_delta(seq: Sequence) -> GenerateDelta:
    """What seq has not sent yet, less the text a stop string may still be forming in."""
    hold = max((len(s) for s in seq.params.stop), default=1) - 1
    return delta(seq, len(seq.text) - hold)


def delta(seq: Sequence, upto: int) -> GenerateDelta:
    upto = max(upto, seq.sent_chars)
    text, seq.sent_chars = seq.text[seq.sent_chars : upto], upto
    toks, seq.sent_tokens = seq.output_ids[seq.sent_tokens :], len(seq.output_ids)
    lps, seq.pending_logprobs = (seq.pending_logprobs or None), []
    return GenerateDelta(seq.request_id, toks, text, lps, prompt_tokens=len(seq.prompt_ids),
                         completion_tokens=len(seq.output_ids), cached_tokens=seq.cached_tokens)


def final_delta(seq: Sequence) -> GenerateDelta:
    """seq's one final delta (seal 1): the rest of its output, and how it ended."""
    outcome = seq.life.outcome
    assert outcome is not None
    d = delta(seq, len(seq.text))
    match outcome.state:
        case State.FINISHED:
            assert outcome.finish_reason is not None
            return msgspec.structs.replace(d, final=outcome.finish_reason.value)
        case State.REJECTED | State.ABORTED | State.FAILED:
            assert outcome.error is not None
            return msgspec.structs.replace(d, final=outcome.state.value, error=outcome.error.to_info(),
                                           stage=seq.life.ended_from.value)
        case _:
            raise AssertionError(f"{seq.request_id}: final delta for non-terminal {outcome.state}")

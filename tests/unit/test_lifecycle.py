"""Seals 1 and 2 at the source: one terminal state, absorbing, always carrying how it ended."""

from __future__ import annotations

import pytest

from kvseal.errors import ContextLengthExceeded, RequestAborted, WorkerFailed
from kvseal.lifecycle import TERMINAL, FinishReason, IllegalTransition, Lifecycle, Outcome, State, describe


def test_happy_path_disaggregated() -> None:
    life = Lifecycle("r")
    for s in (State.ADMITTED, State.RESERVED, State.PREFILLING, State.TRANSFERRING, State.VERIFIED,
              State.DECODING):
        life.advance(s)
    assert life.finish(FinishReason.STOP)
    assert life.outcome == Outcome(State.FINISHED, finish_reason=FinishReason.STOP)


def test_terminal_absorbs_and_keeps_first_outcome() -> None:
    life = Lifecycle("r")
    life.advance(State.ADMITTED)
    err = ContextLengthExceeded("too long")
    assert life.reject(err)
    assert not life.abort(RequestAborted("late"))
    assert not life.fail(WorkerFailed("late"))
    assert life.state is State.REJECTED and life.outcome is not None and life.outcome.error is err
    with pytest.raises(IllegalTransition):
        life.advance(State.PREFILLING)  # a rejected request never walks on (the incident)


def test_finish_only_from_decoding() -> None:
    life = Lifecycle("r")
    life.advance(State.ADMITTED)
    with pytest.raises(IllegalTransition):
        life.finish(FinishReason.LENGTH)  # no "finished" without having decoded


def test_no_skipping_verification() -> None:
    life = Lifecycle("r")
    for s in (State.ADMITTED, State.RESERVED, State.PREFILLING, State.TRANSFERRING):
        life.advance(s)
    with pytest.raises(IllegalTransition):
        life.advance(State.DECODING)


def test_outcome_shape_is_checked() -> None:
    with pytest.raises(IllegalTransition):
        Outcome(State.REJECTED)  # a rejection without its error
    with pytest.raises(IllegalTransition):
        Outcome(State.FINISHED, finish_reason=FinishReason.STOP, error=WorkerFailed("x"))
    with pytest.raises(IllegalTransition):
        Outcome(State.DECODING)


def test_every_state_is_described() -> None:
    assert all(describe(s) for s in State)
    assert TERMINAL == {State.FINISHED, State.REJECTED, State.ABORTED, State.FAILED}

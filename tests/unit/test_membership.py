"""A worker's standing in the router's fleet: SERVING only through CHECKING, every move in one table."""

from __future__ import annotations

import pytest

from kvseal.router.membership import IllegalMove, Membership, Standing, describe


def test_serving_only_through_checking_and_back_after_a_loss() -> None:
    m = Membership("prefill worker tcp://x")
    with pytest.raises(IllegalMove):
        m.move(Standing.SERVING)  # never straight from CONNECTING
    m.move(Standing.CHECKING)
    m.move(Standing.SERVING)
    assert m.serving and m.reason == ""
    m.move(Standing.LOST, "disconnected")
    assert not m.serving and not m.connected and m.reason == "disconnected"
    with pytest.raises(IllegalMove):
        m.move(Standing.SERVING)  # a worker that comes back is checked again
    m.move(Standing.CHECKING)
    m.move(Standing.REFUSED, "its pool holds 512 tokens")
    assert not m.serving and m.connected and "512" in m.reason
    with pytest.raises(IllegalMove):
        m.move(Standing.SERVING)
    m.move(Standing.CHECKING)
    m.move(Standing.SERVING)
    m.move(Standing.DRAINING, "draining")
    assert not m.serving and m.connected
    m.move(Standing.LEFT)
    assert m.move(Standing.LEFT) is False


def test_every_standing_is_described() -> None:
    assert all(describe(s) for s in Standing)

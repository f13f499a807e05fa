"""The KV connector: what a disaggregated role adds to the one Engine, called at fixed points (as vLLM v1's).

A unified engine's connector does nothing. A prefill worker's (engine/kv_prefill.py) takes each sequence out of the
batch once its first token is sampled and hands its KV to decode; a decode worker's (engine/kv_decode.py) reserves
pages, verifies the arrived KV and admits the request into the batch. The handoff's state lives on the Sequence
(`handoff`, `reservation`, `landing`) and its Lifecycle (RESERVED, TRANSFERRING, VERIFIED); the connector keeps no
book of requests of its own, except the requests that ended while bytes may still land in their pages (quarantined:
they left the engine, their pages did not).

The engine calls, in order of a request's life:
  after_prefill(seq, tok, lp)   the prompt is computed and tok sampled: True if the connector took seq (the engine
                                then parks it out of the batch, pages kept) instead of appending tok
  request_finished(seq)         seq reached its terminal state: True if the connector frees its pages later
"""

from __future__ import annotations

from kvseal.engine.sequence import Sequence
from kvseal.wire.messages import TokenLogprob
from kvseal.wire.roles import Role


class KVConnector:
    """A unified engine's: every request is prefilled and decoded here."""

    role = Role.UNIFIED

    def after_prefill(self, seq: Sequence, tok: int, lp: TokenLogprob | None) -> bool:
        return False

    def request_finished(self, seq: Sequence) -> bool:
        return False

    def num_reserved(self) -> int:
        """Requests holding pages outside the scheduler until their KV arrives (decode's reservations)."""
        return 0

"""The KV connector: what a disaggregated role adds to the one Engine, called at fixed points (as vLLM v1's). The
engine builds its own from its role (Engine.kv); its worker asks it for the role's handoff steps.

A unified engine's connector does nothing. A prefill worker's (engine/kv_prefill.py) takes each sequence out of the
batch once its first token is sampled and hands its KV to decode; a decode worker's (engine/kv_decode.py) queues and
reserves pages, verifies the arrived KV and admits the request into the batch. The handoff's state lives on the
Sequence (`handoff`, `reservation`, `landing`) and its Lifecycle (RECEIVED, RESERVED, TRANSFERRING, VERIFIED), in the
engine's one book of requests (engine/requests.py); a connector keeps no book of its own.

The engine calls, in order of a request's life:
  after_prefill(seq, tok, lp)   the prompt is computed and tok sampled: True if the connector took seq (the engine
                                then parks it out of the batch, pages kept) instead of appending tok
  request_finished(seq)         seq reached its terminal state: True if the connector frees its pages later (seq
                                stays in the book, quarantined, until then)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvseal.config import EngineConfig
from kvseal.engine.requests import Requests
from kvseal.engine.scheduler import Scheduler
from kvseal.engine.sequence import Route, Sequence
from kvseal.errors import KvsealError
from kvseal.kv.allocator import PageAllocator
from kvseal.kv.pool import KVPool
from kvseal.ledger.forensics import Forensics
from kvseal.model.arch import ModelArch
from kvseal.transfer.base import Transport
from kvseal.wire.kvspec import KVSpec
from kvseal.wire.messages import GenerateRequest, TokenLogprob
from kvseal.wire.roles import Role


class Host(Protocol):  # what a connector uses of engine/engine.py's Engine, which builds it (importing it: a circle)
    role: Role
    cfg: EngineConfig
    arch: ModelArch
    kv_spec: KVSpec
    pool: KVPool
    allocator: PageAllocator
    scheduler: Scheduler
    requests: Requests
    forensics: Forensics | None
    context_window: int

    def receive(self, req: GenerateRequest, route: Route | None = None) -> Sequence: ...

    def add_request(self, req: GenerateRequest, route: Route | None = None) -> Sequence: ...

    def admit(self, seq: Sequence) -> bool: ...

    def with_grammar(self, seq: Sequence, then: Callable[[], None]) -> None: ...

    def join_batch(self, seq: Sequence, first_token: int, first_logprob: TokenLogprob | None) -> None: ...

    def end(self, seq: Sequence, terminate: Callable[[], bool]) -> None: ...

    def abort(self, request_id: str, cause: KvsealError | None = None) -> None: ...

    def validate(self, num_prompt: int, max_tokens: int) -> None: ...


class KVConnector:
    """A unified engine's: every request is prefilled and decoded here."""

    role = Role.UNIFIED

    def __init__(self, engine: Host) -> None:
        self.engine = engine

    def after_prefill(self, seq: Sequence, tok: int, lp: TokenLogprob | None) -> bool:
        return False

    def request_finished(self, seq: Sequence) -> bool:
        return False

    def register(self, transport: Transport) -> None:
        """Hand the pool to a KV transport, once (it may pin the memory)."""
        transport.register(self.engine.pool.k, self.engine.pool.v)

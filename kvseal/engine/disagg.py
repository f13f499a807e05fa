"""The two halves of the engine for disaggregated serving.

PrefillEngine: computes a prompt's KV and samples the first token, then parks the sequence in TRANSFERRING
with its pages still owned, until the worker reports that decode acknowledged (pages scrubbed and freed)
or refused (the request FAILS here too, pages freed). From the acknowledgement on, decode owns the request.

DecodeEngine: reserves pages for a prompt (RESERVED), and admits the request into its batch only after
the worker verified the arrived KV against that reservation (TRANSFERRING -> VERIFIED -> DECODING).
A reservation that is released (the prefill side refused), or that times out, ends with its error and
its pages scrubbed and freed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvseal.engine.engine import Engine
from kvseal.engine.messages import GenerateDelta, GenerateRequest, TokenLogprob
from kvseal.engine.sequence import Sequence
from kvseal.errors import KvsealError, Overloaded, TransferTimeout
from kvseal.kv.allocator import OutOfPages
from kvseal.lifecycle import State


@dataclass
class Handoff:
    """A prefilled sequence waiting for its KV to be taken by decode."""

    seq: Sequence
    first_token: int
    first_logprob: TokenLogprob | None
    num_pages: int  # pages holding the prompt's KV: ceil(prompt_len / page_size)


class PrefillEngine(Engine):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, role="prefill", **kwargs)  # type: ignore[misc, arg-type]
        self.handoffs: dict[str, Handoff] = {}
        self._ready: list[Handoff] = []

    def take_ready(self) -> list[Handoff]:
        ready, self._ready = self._ready, []
        return ready

    def _on_sampled(self, seq: Sequence, tok: int, lp: TokenLogprob | None) -> None:
        seq.life.advance(State.TRANSFERRING)
        self.scheduler.running.remove(seq)  # out of the batch; its pages stay owned until the handoff ends
        h = Handoff(seq, tok, lp, -(-len(seq.prompt_ids) // self.pool.page_size))
        self.handoffs[seq.request_id] = h
        self._ready.append(h)

    def end_handoff(self, request_id: str, error: KvsealError | None) -> None:
        """Decode acknowledged (error None: release, decode owns the request now) or it did not (FAILED)."""
        h = self.handoffs.pop(request_id, None)
        if h is None:
            return
        seq = h.seq
        if error is None:
            self.allocator.free_all(seq.owner.key)  # scrubbed before reuse
            seq.pages = []
            self.seqs.pop(request_id, None)
        else:
            self._end(seq, lambda: seq.life.fail(error))

    def abort(self, request_id: str, cause: KvsealError | None = None) -> None:
        self.handoffs.pop(request_id, None)
        super().abort(request_id, cause)



class DecodeEngine(Engine):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, role="decode", **kwargs)  # type: ignore[misc, arg-type]
        self.reserved: dict[str, tuple[Sequence, float]] = {}  # request id -> (seq, deadline)

    def reserve(self, req: GenerateRequest, timeout_s: float) -> Sequence:
        """Allocate pages for the prompt's KV. Raises the request's error (nothing is held) on refusal."""
        seq = self._admit(req)
        if seq is None:
            final = self._out.pop()
            assert final.error is not None
            raise KvsealError.from_info(final.error)
        seq.life.advance(State.RESERVED)
        try:
            seq.pages = self.allocator.allocate(seq.owner, -(-len(seq.prompt_ids) // self.pool.page_size))
        except OutOfPages:
            seq.life.reject(Overloaded("the decode worker has no free KV pages right now; retry later"))
            self.seqs.pop(req.request_id, None)
            raise seq.life.outcome.error from None  # type: ignore[union-attr, misc]
        self.reserved[req.request_id] = (seq, time.monotonic() + timeout_s)
        return seq

    def begin_transfer(self, request_id: str) -> Sequence | None:
        entry = self.reserved.get(request_id)
        if entry is None:
            return None
        seq = entry[0]
        if seq.life.state is State.RESERVED:
            seq.life.advance(State.TRANSFERRING)
        return seq

    def admit_verified(self, request_id: str, first_token: int, first_logprob: TokenLogprob | None) -> None:
        """The arrived KV matched the reservation and sits in seq.pages: join the batch."""
        seq, _ = self.reserved.pop(request_id)
        seq.life.advance(State.VERIFIED)
        seq.num_computed = len(seq.prompt_ids)
        seq.first_scheduled = time.monotonic()
        self.scheduler.waiting.append(seq)
        self._append(seq, first_token, first_logprob)

    def release(self, request_id: str, error: KvsealError, rejected: bool) -> None:
        """End a reservation before its KV was used: REJECTED (prefill refused) or FAILED."""
        entry = self.reserved.pop(request_id, None)
        if entry is None:
            self.abort(request_id, error)
            return
        seq = entry[0]
        self._end(seq, lambda: seq.life.reject(error) if rejected else seq.life.fail(error))

    def expire_reservations(self, now: float) -> None:
        for rid, (seq, deadline) in list(self.reserved.items()):
            if now > deadline:
                self.release(rid, TransferTimeout(
                    f"request {rid}: the prefill worker's KV did not arrive in time; reservation released"),
                    rejected=False)

    def abort(self, request_id: str, cause: KvsealError | None = None) -> None:
        self.reserved.pop(request_id, None)
        super().abort(request_id, cause)

    def take_outputs(self) -> list[GenerateDelta]:
        """Outputs produced outside step() (releases, expiries, first tokens)."""
        out, self._out = self._out, []
        return out

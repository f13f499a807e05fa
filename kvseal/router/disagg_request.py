"""One request through a disaggregated fleet, from pairing to its end: the router's one home for it.

The protocol, in the order the methods run (router/disagg.py `DisaggBackend.generate` calls them so):

    reserve   a prefill worker is paired with a decode worker that reserves the request's pages (ADMITTED ->
              RESERVED); a decode worker that started draining after it was picked is replaced by another
    prefill   the prompt goes to prefill with the reservation; prefill sends the KV to decode (PREFILLING)
    next      decode's deltas, the first only after it verified the KV (TRANSFERRING -> VERIFIED -> DECODING);
              a busy prefill queue renews the reservation and never times out, a started handoff is bounded
    settle    an error ends the request once: rejected before the transfer (a refusal releases the reservation
              with its original error: seal 3), failed after it, aborted by the client; both workers are told
    end       whatever ended it (a client that left too): both workers' subscriptions and in-flight counts
              are given back, and the request's last state is its one terminal state (seal 1)

The Lifecycle here is the router's view: decode's word for where a request was when it ended (`stage`) moves
it along the handoff as far as decode says, never further.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvseal.config_fleet import HandoffTimeouts
from kvseal.errors import (
    ErrorInfo,
    KvsealError,
    Overloaded,
    RequestAborted,
    StreamBroken,
    TransferTimeout,
    WorkerDraining,
    WorkerFailed,
)
from kvseal.lifecycle import FinishReason, Lifecycle, State
from kvseal.router.workers import WorkerClient
from kvseal.wire import protocol as P
from kvseal.wire.messages import GenerateDelta, GenerateRequest
from kvseal.wire.reservation import Reservation

log = logging.getLogger("kvseal.router")
PICK_ATTEMPTS = 4  # a decode worker that started draining after it was picked: pick another
_HANDOFF = (State.TRANSFERRING, State.VERIFIED, State.DECODING)  # the router's states after PREFILLING


DEFAULT_TIMEOUTS = HandoffTimeouts()


class DisaggRequest:
    def __init__(self, req: GenerateRequest, timeouts: HandoffTimeouts) -> None:
        self.req = req
        self.timeouts = timeouts
        self.life = Lifecycle(req.request_id)
        self.life.advance(State.ADMITTED)
        self.received = time.time()
        self.prefill: WorkerClient | None = None
        self.decode: WorkerClient | None = None
        self.where: WorkerClient | None = None  # the worker the request is with now (named in its error)
        self.reservation: Reservation | None = None  # decode's, once granted
        # what decode's connection hands in (take_delta): its deltas, numbered 0, 1, 2, ..., then its error
        self._deltas: asyncio.Queue[GenerateDelta | ErrorInfo] = asyncio.Queue()
        self._next_seq = 0  # the number decode's next delta must carry
        self._streaming = False  # decode's deltas are passed on: from start_prefill until a hole, a lost decode
        self._prefill_task: asyncio.Task[P.Message] | None = None
        self._started = asyncio.Event()  # set when prefill reports the KV left
        self._first = True  # no delta from decode yet

    # -- reserve ---------------------------------------------------------------------------------------
    async def reserve(self, pick_prefill: Callable[[], WorkerClient], pick_decode: Callable[[], WorkerClient]) -> None:
        """Pair the prefill worker from pick_prefill() with a decode worker from pick_decode() that reserves the
        pages. The decode worker is known before the wait: a client that leaves while its request is queued there
        gets it aborted there."""
        self.where = self.prefill = pick_prefill()
        self.prefill.routed(self.req.tenant)
        for attempt in range(PICK_ATTEMPTS):
            self.where = self.decode = pick_decode()
            self.decode.routed(self.req.tenant)
            self.reservation = await self._reserve(self.decode, last=attempt == PICK_ATTEMPTS - 1)
            if self.reservation is not None:
                break
            self.decode.routed(self.req.tenant, -1)
            self.decode = None
        assert self.decode is not None  # the last attempt raises instead of returning None
        self.life.advance(State.RESERVED)

    async def _reserve(self, decode: WorkerClient, last: bool) -> Any:
        """A decode worker with no free pages queues the request in arrival order and answers when pages are free
        (for as long as it is alive: a busy fleet is not a timeout); one whose queue is full answers 503 at once.
        None: it started draining after it was picked (unless `last`)."""
        resp = await decode.call(lambda cid: P.ReserveReq(call_id=cid, request=self.req), None)
        if not isinstance(resp, P.ReserveResp):
            raise WorkerFailed(f"{decode.name} answered {type(resp).__name__} to a reservation")
        if resp.reservation is not None:
            return resp.reservation
        err = KvsealError.from_info(resp.error) if resp.error is not None else WorkerFailed(
            f"{decode.name} answered a reservation with neither pages nor an error")
        if isinstance(err, WorkerDraining) and not last:
            return None
        raise err

    # -- prefill ---------------------------------------------------------------------------------------
    def start_prefill(self) -> None:
        assert self.prefill is not None and self.decode is not None and self.reservation is not None
        self._streaming = True
        self.life.advance(State.PREFILLING)
        reservation = self.reservation
        self._prefill_task = asyncio.ensure_future(self.prefill.call(
            lambda cid: P.PrefillReq(call_id=cid, request=self.req, reservation=reservation), None))

    # -- frames from the two workers (their connections' readers, router/workers.py) ----------------------
    def handoff_started(self, w: WorkerClient) -> None:
        """Prefill reports that the KV handoff started (only this request's own prefill worker counts)."""
        if w is self.prefill:
            self._started.set()

    def take_delta(self, w: WorkerClient, msg: P.DeltaMsg) -> None:
        """A delta from decode. They must arrive numbered 0, 1, 2, ...: a gap, a repeat or a reordering ends the
        request FAILED (StreamBroken) instead of passing on an answer with text missing (seal 1); nothing more is
        passed on after that. A delta from any worker but this request's decode is dropped."""
        if w is not self.decode or not self._streaming:
            return
        want = self._next_seq
        if msg.seq != want:
            what = "repeated" if msg.seq < want else f"{msg.seq - want} lost"
            self._deltas.put_nowait(StreamBroken(
                f"request {self.req.request_id}: output from {w.name} arrived with a hole (delta {msg.seq} where "
                f"{want} was due: {what}); the answer would be incomplete, so the request failed").to_info())
            self._streaming = False
            return
        self._next_seq = want + 1
        self._deltas.put_nowait(msg.delta)

    def worker_lost(self, w: WorkerClient, err: ErrorInfo) -> None:
        """A worker's connection was lost: decode's error ends the stream (a lost prefill fails its call)."""
        if w is self.decode and self._streaming:
            self._deltas.put_nowait(err)
            self._streaming = False

    # -- next ------------------------------------------------------------------------------------------
    async def next_delta(self) -> GenerateDelta:
        """Decode's next delta (its last: `final` set); raises the error that ended the request."""
        assert self.decode is not None
        item = await self._wait()
        if isinstance(item, ErrorInfo):
            if self._first and self._started.is_set():
                self._advance_to(State.TRANSFERRING.value)  # prefill said the KV left: it failed in the handoff
            raise KvsealError.from_info(item)
        if item.final is not None and item.error is not None:
            if self._first:  # ended on decode: the request got as far as decode says (a verification failure:
                self._advance_to(item.stage)  # TRANSFERRING), not further
            raise KvsealError.from_info(item.error)
        if self._first:
            self._advance_to(State.DECODING.value)  # decode streams only after it verified the KV
            self._first = False
        if item.final is not None:
            self.life.finish(_finish_reason(item.final, self.decode.name))
            cached = await self._prefill_settled()
            item = msgspec.structs.replace(item, cached_tokens=cached)  # prefill's cache, not decode's
        return item

    async def _wait(self) -> GenerateDelta | ErrorInfo:
        """The next delta from decode, or the error that ends the request (self.where: the worker it is from).

        Before the first one, a prefill failure ends the request, and while the prompt is still queued or
        computing on prefill, decode's reservation is renewed and nothing times out: a busy prefill queue is not
        a transfer timeout (a prefill worker that dies or goes silent fails the request at once). Once prefill
        reports the handoff started, the first delta is due within handoff_s, later ones within stall_s of each
        other; when one is overdue, decode is asked whether it still holds the request (waiting for pages,
        preempted): then the wait goes on, else its final delta was lost and the request fails (StreamBroken)."""
        decode, prefill, task, started = self.decode, self.prefill, self._prefill_task, self._started
        assert decode is not None and prefill is not None and task is not None
        t = self.timeouts
        timeout = decode.card.reservation_timeout_s
        assert timeout is not None  # check_worker admits no decode worker without one
        renew_every = min(t.renew_every_s, timeout / 4)
        deadline: float | None = None
        get = asyncio.ensure_future(self._deltas.get())
        try:
            while True:
                if deadline is None and (not self._first or started.is_set()):
                    deadline = time.monotonic() + (t.handoff_s if self._first else t.stall_s)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    if not await self._still_live(get):
                        break
                    deadline = None
                    continue
                waiting: set[asyncio.Future[Any]] = {get}
                if self._first and not task.done():
                    waiting.add(task)
                wait = renew_every if left is None else (min(left, renew_every) if self._first else left)
                done, _ = await asyncio.wait(waiting, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    self.where = decode
                    return get.result()
                if task in done:
                    if (failed := self._prefill_failed(task)) is not None:
                        self.where = prefill
                        return failed
                    deadline = None  # handed off: decode verified and acked, its first delta is on the way
                elif self._first and not started.is_set():  # prefill still queued or computing
                    await _safe_notify(decode, P.RenewReq(request_id=self.req.request_id))
        finally:
            if not get.done():
                get.cancel()
        self.where = decode
        if self._first:
            return TransferTimeout(f"no verified KV handoff for {self.req.request_id} within {t.handoff_s:g}s of "
                                   f"its start, and {decode.name} no longer holds it").to_info()
        return StreamBroken(f"request {self.req.request_id}: {decode.name} no longer holds it, but its final delta "
                            f"never arrived; the answer is incomplete").to_info()

    def _prefill_failed(self, task: asyncio.Task[P.Message]) -> ErrorInfo | None:
        """Prefill's answer, once in: the error it ended the request with, or None (the handoff was acked)."""
        assert self.prefill is not None
        exc = task.exception()
        if exc is not None:
            return exc.to_info() if isinstance(exc, KvsealError) else WorkerFailed(str(exc)).to_info()
        resp = task.result()
        if not isinstance(resp, P.PrefillResp):
            return WorkerFailed(f"{self.prefill.name} answered {type(resp).__name__} to a prefill").to_info()
        return resp.error

    async def _still_live(self, get: asyncio.Future[Any]) -> bool:
        """Output is overdue: True when decode still holds the request (or output arrived meanwhile). Decode
        answers on the same ordered channel as its deltas: any delta sent before its answer is in by then."""
        assert self.decode is not None
        try:
            resp = await self.decode.call(lambda cid: P.StatusReq(call_id=cid, request_id=self.req.request_id), 30.0)
        except WorkerFailed:
            return get.done()
        return get.done() or (isinstance(resp, P.StatusResp) and resp.live)

    async def _prefill_settled(self) -> int:
        """Decode is done; hold the last delta until prefill reported the handoff ended (its pages scrubbed
        and freed), so a client that sees its response end sees every worker back at baseline (seal 8).
        Bounded: prefill's answer follows decode's ack within milliseconds; a lost answer only logs.
        Returns the prompt tokens prefill served from its prefix cache (0 when unknown)."""
        assert self._prefill_task is not None
        try:
            resp = await asyncio.wait_for(asyncio.shield(self._prefill_task), timeout=10.0)
        except Exception as exc:  # noqa: BLE001 - the output is complete and verified either way
            log.warning("request %s: no handoff answer from prefill after decode finished: %r", self.req.request_id,
                        exc)
            return 0
        return resp.cached_tokens if isinstance(resp, P.PrefillResp) else 0

    def _advance_to(self, stage: str | None) -> None:
        """Move a PREFILLING request along the handoff up to `stage`, decode's word for where the request was when
        it ended (or DECODING for its first output); a stage before the handoff, or unknown, moves nothing."""
        reached = next((i for i, s in enumerate(_HANDOFF) if s.value == stage), -1)
        for s in _HANDOFF[: reached + 1]:
            self.life.advance(s)

    # -- settle ----------------------------------------------------------------------------------------
    async def settle(self, err: KvsealError) -> GenerateDelta:
        """End the request with err (its one terminal state) and tell both workers; the error delta to send."""
        life, rid = self.life, self.req.request_id
        before_transfer = life.state in (State.ADMITTED, State.RESERVED, State.PREFILLING)
        stage = life.state
        if isinstance(err, RequestAborted):
            life.abort(err)
        elif before_transfer and (err.status < 500 or isinstance(err, Overloaded)):
            life.reject(err)
        else:
            life.fail(err)
        if self.decode is not None:
            await _safe_notify(self.decode, P.ReleaseReq(request_id=rid, error=err.to_info(),
                                                          rejected=life.state is State.REJECTED))
        if self.prefill is not None:
            await _safe_notify(self.prefill, P.AbortReq(request_id=rid, error=err.to_info()))
        return GenerateDelta(rid, [], "", final=life.state.value, error=err.to_info(),
                             prompt_tokens=len(self.req.prompt_ids), stage=stage.value,
                             worker=self.where.name if self.where is not None else None)

    # -- end -------------------------------------------------------------------------------------------
    async def end(self) -> None:
        """Runs however the request ended: a consumer that went away (client disconnect) aborts it on both sides;
        the subscriptions and in-flight counts are given back."""
        rid = self.req.request_id
        if not self.life.terminal:
            cause = RequestAborted("the client disconnected")
            self.life.abort(cause)
            for w in (self.decode, self.prefill):
                if w is not None:
                    await _safe_notify(w, P.AbortReq(request_id=rid, error=cause.to_info()))
        if self._prefill_task is not None and not self._prefill_task.done():
            self._prefill_task.cancel()
        self._streaming = False
        for w in (self.prefill, self.decode):
            if w is not None:
                w.routed(self.req.tenant, -1)


def _finish_reason(final: str, worker: str) -> FinishReason:
    try:
        return FinishReason(final)
    except ValueError:
        raise WorkerFailed(f"{worker} ended the request with {final[:40]!r}, which is neither stop, length nor an "
                           f"error; the answer is incomplete") from None


async def _safe_notify(w: WorkerClient, msg: P.Message) -> None:
    try:
        await w.notify(msg)
    except Exception as exc:  # noqa: BLE001 - a dead peer frees its pages by its own timeouts
        log.warning("could not notify %s: %s", w.name, exc)

"""The disaggregated backend: drive each request through reserve -> prefill -> verified handoff -> decode.

The router keeps the request's one Lifecycle. It never yields a token before decode verified the handoff
(decode only streams after verification), a prefill refusal releases the decode reservation and reaches
the client with its original error (seal 3), and every wait ends: a busy fleet is waited out for as long as
its workers answer (a request queued for decode pages or behind other prompts is not a timeout), while a
worker that dies or goes silent fails its requests at once, and a started handoff is bounded.

The fleet stays sealed after start (seal 7): a worker gets requests only while it is SERVING, which it reaches
only by passing the full check (router/registry.py check_worker) whenever it connects, reconnects, registers
through the fleet socket (`kvseal prefill|decode --router`), or answers as a new process.

With fleet keys (kvseal/auth) every socket here is CURVE both ways: the router pins each worker's key when it
connects (`server_keys`; a joining worker's key is the one its join handshake proved), and the fleet socket
completes a handshake only with allow-listed members, so a stranger's JoinReq is never read.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvseal.auth.curve import as_server
from kvseal.auth.keys import MemberKeys
from kvseal.auth.zap import ZapHandler
from kvseal.engine.messages import GenerateDelta, GenerateRequest
from kvseal.errors import (
    CapacityMismatch,
    ErrorInfo,
    KvsealError,
    NoWorkerAvailable,
    Overloaded,
    RequestAborted,
    StreamBroken,
    TransferTimeout,
    WorkerDraining,
    WorkerFailed,
)
from kvseal.hooks import NO_FAULTS, Hooks
from kvseal.identity import tokenizer_digest
from kvseal.ledger.store import Ledger, LedgerRow
from kvseal.lifecycle import FinishReason, Lifecycle, State
from kvseal.model.tokenizer import Tokenizer
from kvseal.router.affinity import PrefixAffinity
from kvseal.router.registry import FleetSpec, check_fleet, check_worker, served_window
from kvseal.router.workers import WorkerClient
from kvseal.worker import protocol as P
from kvseal.worker.card import WorkerCard

log = logging.getLogger("kvseal.router")
_PICK_ATTEMPTS = 4  # a decode worker that started draining after it was picked: pick another


_HANDOFF = (State.TRANSFERRING, State.VERIFIED, State.DECODING)  # the router's states after PREFILLING


def _advance_to(life: Lifecycle, stage: str | None) -> None:
    """Move a PREFILLING request along the handoff up to `stage`, decode's word for where the request was when it
    ended (or DECODING for its first output); a stage before the handoff, or unknown, moves nothing."""
    reached = next((i for i, s in enumerate(_HANDOFF) if s.value == stage), -1)
    for s in _HANDOFF[: reached + 1]:
        life.advance(s)


def _finish_reason(final: str, worker: str) -> FinishReason:
    try:
        return FinishReason(final)
    except ValueError:
        raise WorkerFailed(f"{worker} ended the request with {final[:40]!r}, which is neither stop, length nor an "
                           f"error; the answer is incomplete") from None


class DisaggBackend:
    def __init__(self, tokenizer: Tokenizer, model_name: str | None, prefill: list[str], decode: list[str],
                 max_model_len: int | None = None, startup_timeout_s: float = 300.0,
                 handoff_timeout_s: float = 600.0, stall_timeout_s: float = 120.0, renew_every_s: float = 10.0,
                 hooks: Hooks = NO_FAULTS, fleet_bind: str | None = None, ledger: Ledger | None = None,
                 keys: MemberKeys | None = None, server_keys: dict[str, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self._name = model_name
        self.model_name = model_name or ""
        self.prefill_eps, self.decode_eps = prefill, decode
        self.max_model_len = max_model_len
        self.startup_timeout_s, self.handoff_timeout_s = startup_timeout_s, handoff_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.renew_every_s = renew_every_s  # at most this, and at most a quarter of decode's reservation timeout
        self.hooks = hooks
        self.fleet_bind = fleet_bind
        self.ledger = ledger  # the forensic ledger: one row per ended request (kvseal/ledger)
        self.fleet_endpoint: str | None = None
        self.keys = keys  # the router's fleet keys; None: plain ZeroMQ (loopback only)
        self.server_keys = dict(server_keys or {})  # worker control endpoint -> its fleet public key (pinned)
        self._zap: ZapHandler | None = None
        self.context_window = 0
        self.spec: FleetSpec | None = None
        self.prefills: list[WorkerClient] = []
        self.decodes: list[WorkerClient] = []
        self.lifecycles: dict[str, Lifecycle] = {}  # live requests only
        self.ended: dict[str, int] = {s.value: 0 for s in (State.FINISHED, State.REJECTED, State.ABORTED,
                                                           State.FAILED)}
        self._ctx: zmq.asyncio.Context | None = None
        self.affinity = PrefixAffinity()  # which prefill worker likely holds a prompt's prefix
        self._fleet_sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- fleet ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        if self.keys is not None:  # before any server socket binds: no handshake goes unchecked
            self._zap = ZapHandler(self._ctx, self.keys, "router's fleet port")
        self.prefills = [self._client("prefill", ep) for ep in self.prefill_eps]
        self.decodes = [self._client("decode", ep) for ep in self.decode_eps]
        workers = self.prefills + self.decodes
        for w in workers:
            w.open()
        deadline = time.monotonic() + self.startup_timeout_s
        cards: list[tuple[str, WorkerCard]] = []
        for w in workers:
            while True:
                try:
                    cards.append((w.name, (await w.fetch_info(timeout=2.0)).card))
                    break
                except CapacityMismatch as err:  # its card does not decode: another kvseal version
                    log.error("refusing to start: %s", err.message)
                    raise
                except WorkerFailed:
                    if time.monotonic() > deadline:
                        raise WorkerFailed(f"{w.name} did not come up within {self.startup_timeout_s:g}s")
        try:
            self.context_window = served_window(cards, self.max_model_len)
            check_fleet(cards, self.context_window)
        except CapacityMismatch as err:
            if self.hooks.capacity_check():
                log.error("refusing to start: %s", err.message)
                raise
            log.warning("capacity mismatch ignored (test fault): %s", err.message)  # the 2026 behaviour
        self.spec = FleetSpec.of(cards, self.context_window, tokenizer_digest(self.tokenizer), self.hooks.spec)
        for w, (_, card) in zip(workers, cards, strict=True):
            self._check(w, card)  # tokenizer and test faults too: a fleet that fails never serves
        for w, (_, card) in zip(workers, cards, strict=True):
            w.admitted(card)
            w.watch()
        self.model_name = self._name or cards[0][1].model
        if self.fleet_bind is not None:
            self._fleet_sock = self._ctx.socket(zmq.ROUTER)
            self._fleet_sock.setsockopt(zmq.LINGER, 0)
            as_server(self._fleet_sock, self.keys)
            self._fleet_sock.bind(self.fleet_bind)
            self.fleet_endpoint = self._fleet_sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._tasks.append(asyncio.ensure_future(self._fleet_loop()))
        log.info("serving %s from %d prefill and %d decode workers; context window %d tokens; workers join at %s",
                 self.model_name, len(self.prefills), len(self.decodes), self.context_window,
                 self.fleet_endpoint or "(no fleet socket)")

    def _client(self, role: str, endpoint: str, registered: bool = False, key: str | None = None) -> WorkerClient:
        assert self._ctx is not None
        return WorkerClient(role, endpoint, self._ctx, self._check, registered=registered, keys=self.keys,
                            server_key=key or self.server_keys.get(endpoint))

    def _check(self, w: WorkerClient, card: WorkerCard) -> None:
        assert self.spec is not None
        check_worker(w.name, w.role, card, self.spec, capacity=self.hooks.capacity_check())

    async def _fleet_loop(self) -> None:
        """Workers started with --router ask to join here; each is checked in full before its answer."""
        assert self._fleet_sock is not None
        while True:
            frames = await self._fleet_sock.recv_multipart(copy=False)
            if len(frames) != 2:
                continue
            try:
                msg = P.decode(frames[1].bytes)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("dropping a malformed message on the fleet socket: %s", exc)
                continue
            # with keys: the public key this member's handshake proved (set by the ZAP handler), else None
            try:
                key = str(frames[1].get("User-Id")) if self.keys is not None else None
            except zmq.ZMQError:  # no proven key (the socket lost its CURVE?): not a member's message
                log.error("dropping a message on the fleet socket from a peer whose key no handshake proved")
                continue
            if isinstance(msg, P.JoinReq):
                self._tasks.append(asyncio.ensure_future(self._join(frames[0].bytes, msg, key or None)))

    async def _join(self, ident: bytes, req: P.JoinReq, key: str | None = None) -> None:
        assert self._fleet_sock is not None
        accepted, reason = False, ""
        pool = self.prefills if req.role == "prefill" else self.decodes
        w = next((x for x in pool if x.endpoint == req.endpoint), None)
        if req.role not in ("prefill", "decode") or not req.endpoint.startswith("tcp://"):
            reason = f"a join needs role prefill or decode and a tcp:// endpoint, got {req.role!r} {req.endpoint!r}"
        elif w is not None and w.server_key != key:
            reason = (f"{req.endpoint} belongs to a fleet member with another key; a worker joins only at its own "
                      f"endpoint (give it a free --port, or restart the router to replace that member)")
        else:
            if w is None:
                w = self._client(req.role, req.endpoint, registered=True, key=key)
                pool.append(w)
                w.open()
                w.watch()
            await w.join()
            accepted, reason = w.member.serving, w.member.reason
        log.log(logging.INFO if accepted else logging.ERROR, "join of %s %s: %s", req.role, req.endpoint,
                "accepted" if accepted else f"refused: {reason}")
        await self._fleet_sock.send_multipart([ident, P.encode(P.JoinResp(
            call_id=req.call_id, accepted=accepted, reason=reason, context_window=self.context_window))])

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self.prefills + self.decodes:
            await w.close()
        if self._fleet_sock is not None:
            self._fleet_sock.close(0)
        if self._zap is not None:
            self._zap.stop()
        if self._ctx is not None:
            self._ctx.term()

    async def healthy(self) -> bool:
        return any(w.alive for w in self.prefills) and any(w.alive for w in self.decodes)

    async def info(self) -> dict[str, Any]:
        # fresh from every connected worker (the heartbeat's copy may be a second old); a worker that does not
        # answer within 2 s is shown with its last known figures
        live = [w for w in self.prefills + self.decodes if w.member.connected]
        await asyncio.gather(*(w.fetch_info(timeout=2.0) for w in live), return_exceptions=True)
        clients = self.prefills + self.decodes
        workers = [{**w.info_json(), "role": w.role, "endpoint": w.endpoint, "alive": w.alive,
                    "state": w.member.standing.value, "reason": w.member.reason, "registered": w.registered,
                    "inflight": w.inflight} for w in clients]
        # the fleet's figures from the serving workers' cards (all of them while none serves); a worker that
        # never answered has no card: it counts as a pool of 0 tokens, and the figures it cannot give are None
        serving = [w for w in clients if w.alive] or clients
        cards = [None if w.last is None else w.last.card for w in serving]
        first = cards[0] if cards else None
        return {"role": "router", "model": self.model_name, "context_window": self.context_window,
                "model_fingerprint": None if first is None else first.kv.model_fingerprint,
                "pool_tokens": min((0 if c is None else c.pool_tokens for c in cards), default=0),
                "page_size": None if first is None else first.kv.page_size,
                "kv_dtype": None if first is None else first.kv.kv_dtype,
                "kv_transport": None if first is None else first.kv_transport,
                "tokenizer_digest": self.spec.tokenizer_digest if self.spec else None,
                "test_faults": self.hooks.spec, "fleet_endpoint": self.fleet_endpoint,
                "fleet_auth": "curve" if self.keys is not None else "off",
                "auth_refused": self._zap.refused if self._zap is not None else 0,
                "live_requests": len(self.lifecycles), "ended": dict(self.ended),
                "routed_by_prefix": self.affinity.routed_by_prefix, "workers": workers}

    def _pick(self, pool: list[WorkerClient], role: str, req: GenerateRequest | None = None) -> WorkerClient:
        """The least loaded serving worker (ties at random); for prefill with `req`, the one most likely to hold
        the prompt's prefix in its cache unless that one is much busier (router/affinity.py). None serving:
        503 with each worker's state and why."""
        live = [w for w in pool if w.alive]
        if not live:
            out = "; ".join(f"{w.endpoint} {w.member.standing.value}" + (f" ({w.member.reason})" if
                            w.member.reason else "") for w in pool)
            raise NoWorkerAvailable(f"no {role} worker is serving right now ({out or 'none configured'}); "
                                    f"retry later")
        if req is not None:
            return self.affinity.pick(live, req, live[0].card.kv.page_size)
        least = min(w.inflight for w in live)
        return random.choice([w for w in live if w.inflight == least])

    # -- one request ----------------------------------------------------------------------------------
    def _pinned(self, pool: list[WorkerClient], role: str, endpoint: str) -> WorkerClient:
        """The serving worker at `endpoint` (kvseal doctor's probe of one pair); 503 when it is not serving."""
        for w in pool:
            if w.endpoint == endpoint and w.alive:
                return w
        raise NoWorkerAvailable(f"no serving {role} worker at {endpoint}")

    async def generate(self, req: GenerateRequest,
                       pin: tuple[str, str] | None = None) -> AsyncGenerator[GenerateDelta, None]:
        """pin: (prefill endpoint, decode endpoint) to use instead of the pairing policy (kvseal doctor)."""
        rid = req.request_id
        life = Lifecycle(rid)
        self.lifecycles[rid] = life
        life.advance(State.ADMITTED)
        prefill = decode = where = None
        reservation: Any = None
        received = time.time()
        q: asyncio.Queue[GenerateDelta | ErrorInfo] | None = None
        prefill_task: asyncio.Task[P.Message] | None = None
        try:
            where = prefill = (self._pinned(self.prefills, "prefill", pin[0]) if pin
                               else self._pick(self.prefills, "prefill", req))
            prefill.inflight += 1
            for attempt in range(_PICK_ATTEMPTS):
                # the decode worker is known before the wait: a client that leaves while its request is queued
                # there gets it aborted there (finally, below)
                where = decode = self._pinned(self.decodes, "decode", pin[1]) if pin else self._pick(
                    self.decodes, "decode")
                decode.inflight += 1
                reservation = await self._reserve(decode, req, last=attempt == _PICK_ATTEMPTS - 1)
                if reservation is not None:
                    break
                decode.inflight -= 1
                decode = None
            assert decode is not None  # the last attempt raises instead of returning None
            life.advance(State.RESERVED)
            q = decode.subscribe(rid)
            started = prefill.watch_handoff(rid)
            life.advance(State.PREFILLING)
            prefill_task = asyncio.ensure_future(prefill.call(
                lambda cid: P.PrefillReq(call_id=cid, request=req, reservation=reservation), None))
            first = True
            while True:
                item, where = await self._next(q, prefill_task, started, prefill, decode, first, req)
                if isinstance(item, ErrorInfo):
                    if first and started.is_set():  # prefill said the KV left: it failed in the handoff
                        _advance_to(life, State.TRANSFERRING.value)
                    raise KvsealError.from_info(item)
                if item.final is not None and item.error is not None:
                    if first:  # ended on decode: the request got as far as decode says (a verification
                        _advance_to(life, item.stage)  # failure: TRANSFERRING), not further
                    raise KvsealError.from_info(item.error)
                if first:
                    _advance_to(life, State.DECODING.value)  # decode streams only after it verified the KV
                    first = False
                if item.final is not None:
                    life.finish(_finish_reason(item.final, decode.name))
                    cached = await self._prefill_settled(prefill_task, rid)
                    item = msgspec.structs.replace(item, cached_tokens=cached)  # prefill's cache, not decode's
                yield item
                if item.final is not None:
                    return
        except KvsealError as err:
            before_transfer = life.state in (State.ADMITTED, State.RESERVED, State.PREFILLING)
            stage = life.state
            if isinstance(err, RequestAborted):
                life.abort(err)
            elif before_transfer and (err.status < 500 or isinstance(err, Overloaded)):
                life.reject(err)
            else:
                life.fail(err)
            if decode is not None:
                await self._safe_notify(decode, P.ReleaseReq(request_id=rid, error=err.to_info(),
                                                              rejected=life.state is State.REJECTED))
            if prefill is not None:
                await self._safe_notify(prefill, P.AbortReq(request_id=rid, error=err.to_info()))
            yield GenerateDelta(rid, [], "", final=life.state.value, error=err.to_info(),
                                prompt_tokens=len(req.prompt_ids), stage=stage.value,
                                worker=where.name if where is not None else None)
        finally:
            if not life.terminal:  # the consumer went away (client disconnect): abort on both sides
                cause = RequestAborted("the client disconnected")
                life.abort(cause)
                for w in (decode, prefill):
                    if w is not None:
                        await self._safe_notify(w, P.AbortReq(request_id=rid, error=cause.to_info()))
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()
            if q is not None and decode is not None:
                decode.unsubscribe(rid)
            if prefill is not None:
                prefill.unsubscribe(rid)
            for w in (prefill, decode):
                if w is not None:
                    w.inflight -= 1
            self.lifecycles.pop(rid, None)
            self.ended[life.state.value] = self.ended.get(life.state.value, 0) + 1
            if self.ledger is not None:
                error = life.outcome.error if life.outcome is not None else None
                self.ledger.add(LedgerRow(
                    request_id=rid, role="router", worker="router", tenant=req.tenant, received=received,
                    ended=time.time(), state=life.state.value, error_code=error.code if error else None,
                    prefill_worker=prefill.endpoint if prefill else None,
                    decode_worker=decode.endpoint if decode else None,
                    reservation_id=reservation.reservation_id if reservation is not None else None))

    async def _reserve(self, decode: WorkerClient, req: GenerateRequest, last: bool) -> Any:
        """Reserve decode pages. A decode worker with no free pages queues the request in arrival order and
        answers when pages are free (for as long as it is alive: a busy fleet is not a timeout); one whose
        queue is full answers 503 at once. None: it started draining after it was picked (unless `last`)."""
        resp = await decode.call(lambda cid: P.ReserveReq(call_id=cid, request=req), None)
        if not isinstance(resp, P.ReserveResp):
            raise WorkerFailed(f"{decode.name} answered {type(resp).__name__} to a reservation")
        if resp.reservation is not None:
            return resp.reservation
        err = KvsealError.from_info(resp.error) if resp.error is not None else WorkerFailed(
            f"{decode.name} answered a reservation with neither pages nor an error")
        if isinstance(err, WorkerDraining) and not last:
            return None
        raise err

    async def _next(self, q: asyncio.Queue[GenerateDelta | ErrorInfo], prefill_task: asyncio.Task[P.Message],
                    started: asyncio.Event, prefill: WorkerClient, decode: WorkerClient, first: bool,
                    req: GenerateRequest) -> tuple[GenerateDelta | ErrorInfo, WorkerClient]:
        """The next delta from decode, and the worker it is from (or that failed the request).

        Before the first one, a prefill failure ends the request, and while the prompt is still queued or
        computing on prefill, decode's reservation is renewed and nothing times out: a busy prefill queue is not
        a transfer timeout (a prefill worker that dies or goes silent fails the request at once). Once prefill
        reports the handoff started, the first delta is due within handoff_timeout_s, later ones within
        stall_timeout_s of each other; when one is overdue, decode is asked whether it still holds the request
        (waiting for pages, preempted): then the wait goes on, else its final delta was lost and the request
        fails (StreamBroken)."""
        timeout = decode.card.reservation_timeout_s
        assert timeout is not None  # check_worker admits no decode worker without one
        renew_every = min(self.renew_every_s, timeout / 4)
        deadline: float | None = None
        get = asyncio.ensure_future(q.get())
        done: set[asyncio.Future[Any]] = set()
        try:
            while not done:
                if deadline is None and (not first or started.is_set()):
                    deadline = time.monotonic() + (self.handoff_timeout_s if first else self.stall_timeout_s)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    if not await self._still_live(decode, req.request_id, get):
                        break
                    deadline = None
                    continue
                waiting: set[asyncio.Future[Any]] = {get}
                if first and not prefill_task.done():
                    waiting.add(prefill_task)
                wait = renew_every if left is None else (min(left, renew_every) if first else left)
                done, _ = await asyncio.wait(waiting, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if first and not done and not started.is_set():  # prefill still queued or computing
                    await self._safe_notify(decode, P.RenewReq(request_id=req.request_id))
        finally:
            if not get.done():
                get.cancel()
        if get in done:
            return get.result(), decode
        if prefill_task in done:
            exc = prefill_task.exception()
            if exc is not None:
                return (exc.to_info() if isinstance(exc, KvsealError) else WorkerFailed(str(exc)).to_info()), prefill
            resp = prefill_task.result()
            if not isinstance(resp, P.PrefillResp):
                return WorkerFailed(f"{prefill.name} answered {type(resp).__name__} to a prefill").to_info(), prefill
            if resp.error is not None:
                return resp.error, prefill
            # handed off: decode verified and acked, its first delta is on the way
            return await self._next(q, prefill_task, started, prefill, decode, first, req)
        if first:
            return TransferTimeout(f"no verified KV handoff for {req.request_id} within "
                                   f"{self.handoff_timeout_s:g}s of its start, and {decode.name} no longer holds "
                                   f"it").to_info(), decode
        return StreamBroken(f"request {req.request_id}: {decode.name} no longer holds it, but its final delta "
                            f"never arrived; the answer is incomplete").to_info(), decode

    async def _still_live(self, decode: WorkerClient, rid: str, get: asyncio.Future[Any]) -> bool:
        """Output is overdue: True when decode still holds the request (or output arrived meanwhile). Decode
        answers on the same ordered channel as its deltas: any delta sent before its answer is in by then."""
        try:
            resp = await decode.call(lambda cid: P.StatusReq(call_id=cid, request_id=rid), 30.0)
        except WorkerFailed:
            return get.done()
        return get.done() or (isinstance(resp, P.StatusResp) and resp.live)

    async def _prefill_settled(self, task: asyncio.Task[P.Message], rid: str) -> int:
        """Decode is done; hold the last delta until prefill reported the handoff ended (its pages scrubbed
        and freed), so a client that sees its response end sees every worker back at baseline (seal 8).
        Bounded: prefill's answer follows decode's ack within milliseconds; a lost answer only logs.
        Returns the prompt tokens prefill served from its prefix cache (0 when unknown)."""
        try:
            resp = await asyncio.wait_for(asyncio.shield(task), timeout=10.0)
        except Exception as exc:  # noqa: BLE001 - the output is complete and verified either way
            log.warning("request %s: no handoff answer from prefill after decode finished: %r", rid, exc)
            return 0
        return resp.cached_tokens if isinstance(resp, P.PrefillResp) else 0

    async def _safe_notify(self, w: WorkerClient, msg: P.Message) -> None:
        try:
            await w.notify(msg)
        except Exception as exc:  # noqa: BLE001 - a dead peer frees its pages by its own timeouts
            log.warning("could not notify %s: %s", w.name, exc)


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
from kvseal.errors import (
    CapacityMismatch,
    KvsealError,
    NoWorkerAvailable,
    WorkerFailed,
)
from kvseal.hooks import NO_FAULTS, Hooks
from kvseal.identity import tokenizer_digest
from kvseal.ledger.store import Ledger, LedgerRow
from kvseal.lifecycle import State
from kvseal.model.tokenizer import Tokenizer
from kvseal.router.affinity import PrefixAffinity
from kvseal.router.disagg_request import DEFAULT_TIMEOUTS, DisaggRequest, HandoffTimeouts
from kvseal.router.pick import fair_candidates
from kvseal.router.registry import FleetSpec, check_fleet, check_worker, served_window
from kvseal.router.workers import WorkerClient
from kvseal.wire import protocol as P
from kvseal.wire.card import WorkerCard
from kvseal.wire.messages import GenerateDelta, GenerateRequest
from kvseal.wire.roles import Role

log = logging.getLogger("kvseal.router")


class DisaggBackend:
    def __init__(self, tokenizer: Tokenizer, model_name: str | None, prefill: list[str], decode: list[str],
                 max_model_len: int | None = None, startup_timeout_s: float = 300.0,
                 timeouts: HandoffTimeouts = DEFAULT_TIMEOUTS, hooks: Hooks = NO_FAULTS,
                 fleet_bind: str | None = None, ledger: Ledger | None = None, keys: MemberKeys | None = None,
                 server_keys: dict[str, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self._name = model_name
        self.model_name = model_name or ""
        self.prefill_eps, self.decode_eps = prefill, decode
        self.max_model_len = max_model_len
        self.startup_timeout_s = startup_timeout_s
        self.timeouts = timeouts  # of one request's handoff and stream (router/disagg_request.py)
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
        self.requests: dict[str, DisaggRequest] = {}  # the live requests, each in its one home
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
        self.prefills = [self._client(Role.PREFILL, ep) for ep in self.prefill_eps]
        self.decodes = [self._client(Role.DECODE, ep) for ep in self.decode_eps]
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

    def _client(self, role: Role, endpoint: str, registered: bool = False, key: str | None = None) -> WorkerClient:
        assert self._ctx is not None
        return WorkerClient(role, endpoint, self._ctx, self._check, registered=registered, keys=self.keys,
                            server_key=key or self.server_keys.get(endpoint), requests=self.requests)

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
        pool = self.prefills if req.role == Role.PREFILL else self.decodes
        w = next((x for x in pool if x.endpoint == req.endpoint), None)
        if req.role not in (Role.PREFILL, Role.DECODE) or not req.endpoint.startswith("tcp://"):
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
        tasks, self._tasks = self._tasks, []  # a router starts twice (the start-up probe, then uvicorn's loop):
        for t in tasks:  # the second stop must not gather the first loop's tasks (it is closed by then)
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
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
                "live_requests": len(self.requests), "ended": dict(self.ended),
                "routed_by_prefix": self.affinity.routed_by_prefix, "workers": workers}

    def _pick(self, pool: list[WorkerClient], role: Role, req: GenerateRequest) -> WorkerClient:
        """A serving worker for req: among those the fleet's fairness allows (router/pick.py), for prefill
        the one most likely to hold the prompt's prefix in its cache unless that one is much busier
        (router/affinity.py), else the least loaded (ties at random). None serving: 503 with each worker's state
        and why."""
        live = [w for w in pool if w.alive]
        if not live:
            out = "; ".join(f"{w.endpoint} {w.member.standing.value}" + (f" ({w.member.reason})" if
                            w.member.reason else "") for w in pool)
            raise NoWorkerAvailable(f"no {role} worker is serving right now ({out or 'none configured'}); "
                                    f"retry later")
        live = fair_candidates(live, req.tenant)
        if role == Role.PREFILL:
            return self.affinity.pick(live, req, live[0].card.kv.page_size)
        least = min(w.inflight for w in live)
        return random.choice([w for w in live if w.inflight == least])

    # -- one request ----------------------------------------------------------------------------------
    def _pinned(self, pool: list[WorkerClient], role: Role, endpoint: str) -> WorkerClient:
        """The serving worker at `endpoint` (kvseal doctor's probe of one pair); 503 when it is not serving."""
        for w in pool:
            if w.endpoint == endpoint and w.alive:
                return w
        raise NoWorkerAvailable(f"no serving {role} worker at {endpoint}")

    async def generate(self, req: GenerateRequest,
                       pin: tuple[str, str] | None = None) -> AsyncGenerator[GenerateDelta, None]:
        """One request, along the protocol (router/disagg_request.py). pin: (prefill endpoint, decode endpoint)
        to use instead of the pairing policy (kvseal doctor)."""
        def pick_prefill() -> WorkerClient:
            pool = self.prefills
            return self._pinned(pool, Role.PREFILL, pin[0]) if pin else self._pick(pool, Role.PREFILL, req)

        def pick_decode() -> WorkerClient:
            pool = self.decodes
            return self._pinned(pool, Role.DECODE, pin[1]) if pin else self._pick(pool, Role.DECODE, req)

        r = DisaggRequest(req, self.timeouts)
        self.requests[req.request_id] = r  # from here on, the workers' connections hand its frames to r
        try:
            await r.reserve(pick_prefill, pick_decode)
            r.start_prefill()
            while True:
                delta = await r.next_delta()
                yield delta
                if delta.final is not None:
                    return
        except KvsealError as err:
            yield await r.settle(err)
        finally:
            await r.end()
            self._ended(r)

    def _ended(self, r: DisaggRequest) -> None:
        """The request's one terminal state is counted, and its row goes to the forensic ledger."""
        life = r.life
        self.requests.pop(r.req.request_id, None)
        self.ended[life.state.value] = self.ended.get(life.state.value, 0) + 1
        if self.ledger is not None:
            error = life.outcome.error if life.outcome is not None else None
            self.ledger.add(LedgerRow(
                request_id=r.req.request_id, role="router", worker="router", tenant=r.req.tenant,
                received=r.received, ended=time.time(), state=life.state.value,
                error_code=error.code if error else None,
                prefill_worker=r.prefill.endpoint if r.prefill else None,
                decode_worker=r.decode.endpoint if r.decode else None,
                reservation_id=r.reservation.reservation_id if r.reservation is not None else None))

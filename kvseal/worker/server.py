"""A worker process: an engine behind a ZeroMQ control socket, one thread, one loop.

Each turn of the loop: read every pending control message, let the role move KV (prefill: send and poll
handoffs; decode: receive, verify, admit), run one engine step if there is work, and route the outputs.
Messages wait at most one engine step.

No frame from a peer ends this process: a message that does not decode is dropped, one that a handler cannot
take is refused with a log line, and a handler that fails unexpectedly fails only the request it named.
Answers go out through an Outbox (nothing dropped silently). SIGTERM or a DrainReq (`kvseal drain`) starts a
drain: the routers are told, no new request is taken, and the process exits once those in flight have ended.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import torch
import zmq

from kvseal.auth.curve import as_server
from kvseal.auth.keys import MemberKeys
from kvseal.auth.zap import ZapHandler
from kvseal.engine.engine import Engine
from kvseal.engine.sequence import Sequence
from kvseal.errors import InternalError, InvalidRequest, KvsealError, WorkerDraining
from kvseal.hooks import Hooks
from kvseal.identity import new_instance_id, tokenizer_digest
from kvseal.metrics.engine import EngineCollector, WorkerMetrics
from kvseal.wire import protocol as P
from kvseal.wire.card import WorkerCard
from kvseal.wire.messages import GenerateDelta
from kvseal.wire.roles import Role
from kvseal.worker.cores import CoreLending
from kvseal.worker.join import EXIT_REFUSED, Registrations
from kvseal.worker.outbox import Outbox

log = logging.getLogger("kvseal.worker")

# exit status of a worker whose --router refused it (the reason is in its log and in the router's /info)


class WorkerServer:
    role: Role  # set by each role's class
    kv_transport: str  # set by each role's __init__ (--kv-transport)

    def __init__(self, engine: Engine, bind: str, hooks: Hooks, drain_timeout_s: float = 600.0,
                 keys: MemberKeys | None = None) -> None:
        self.engine, self.hooks = engine, hooks
        self.ctx = zmq.Context()
        self.keys = keys  # fleet keys: CURVE both ways on every socket (kvseal/auth); None: loopback, plain
        # with keys, only allow-listed members complete a handshake: nobody else gets a frame read or answered
        self.zap = ZapHandler(self.ctx, keys, "control port") if keys is not None else None
        self.ctrl: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        as_server(self.ctrl, keys)
        self.ctrl.setsockopt(zmq.LINGER, 0)
        self.ctrl.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.ctrl.bind(bind)
        self.endpoint = self.ctrl.getsockopt_string(zmq.LAST_ENDPOINT)
        engine.set_worker(self.endpoint)
        self.outbox = Outbox(self.ctrl)
        self.poller = zmq.Poller()
        self.poller.register(self.ctrl, zmq.POLLIN)
        self._stop = False
        self.exit_code = 0
        self.instance = new_instance_id()
        self.tokenizer_digest = tokenizer_digest(engine.tokenizer)
        self.peers: set[bytes] = set()  # every router that sent a message: told when this worker drains
        self.drain_timeout_s = drain_timeout_s
        self.draining_since: float | None = None
        self._drain_asked: str | None = None
        self.join: Registrations | None = None  # set when started with --router
        self.lending: CoreLending | None = None  # set for `kvseal serve`'s workers: idle siblings' cores (cores.py)
        self._threads: int | None = None  # the threads of the last step with lending (None: the start's)
        # set by `kvseal serve` (launch.Fleet) for the workers it starts: never outlive that process, even one
        # that died while this worker was still loading its model. A worker started on its own has no parent.
        launcher = os.environ.get(P.LAUNCHER_PID_ENV)
        self._parent = int(launcher) if launcher else None
        self.counters: dict[str, int] = {"kv_bytes_sent": 0, "kv_bytes_received": 0, "transfers_acked": 0,
                                         "transfers_refused": 0, "requests_received": 0, "frames_refused": 0,
                                         "steps_on_lent_cores": 0}
        self.verification_failures: dict[str, int] = {}  # decode: refused handoffs by manifest field (seal 4)
        self.metrics = WorkerMetrics(EngineCollector(engine, self.counters, self.verification_failures,
                                                     self.queued, {"test_faults": hooks.spec,
                                                                   "endpoint": self.endpoint},
                                                     kv_figures=self.kv_figures))

    # -- plumbing ---------------------------------------------------------------------------------------
    def send(self, ident: bytes, msg: P.Message) -> None:
        self.outbox.send(ident, P.encode(msg))

    def card(self) -> WorkerCard:
        """What this worker is (wire/card.py): the router's fleet check compares it with the fleet's."""
        return self.engine.card(
            role=self.role, instance=self.instance, kv_transport=self.kv_transport,
            tokenizer_digest=self.tokenizer_digest, test_faults=self.hooks.spec,
            fleet_auth="curve" if self.keys is not None else "off", reservation_timeout_s=self.reservation_timeout())

    def reservation_timeout(self) -> float | None:
        """decode: how long a reservation waits for its KV; None for a role that takes no reservation."""
        return None

    def figures(self) -> dict[str, Any]:
        """Where it listens and what it counts (InfoResp.figures): shown in /info, never checked."""
        return {**self.engine.figures(), **self.counters, "control_endpoint": self.endpoint,
                "test_faults_active": self.hooks.active, "inflight": self.inflight(),
                "outbox_queued": self.outbox.queued, "metrics_endpoint": self.metrics.endpoint,
                "verification_failures": dict(self.verification_failures), "auth_refused": self.auth_refused()}

    def info_resp(self, call_id: int) -> P.InfoResp:
        return P.InfoResp(call_id=call_id, card=self.card(), draining=self.draining_since is not None,
                          figures=self.figures())

    def info(self) -> dict[str, Any]:
        """This worker's /info, as the router shows it (InfoResp.to_json)."""
        return self.info_resp(0).to_json()

    def auth_refused(self) -> int:
        """Connections refused at the handshake (not on the fleet allow-list): control port, and KV port."""
        return (self.zap.refused if self.zap is not None else 0) + int(getattr(getattr(self, "transport", None),
                                                                               "auth_refused", 0))

    def queued(self) -> int:
        """Requests waiting outside the engine (decode: reservations waiting for pages)."""
        return 0

    def kv_figures(self) -> dict[str, int]:
        """What the KV transport holds now (reads past their deadline, pages kept for them), see metrics/engine."""
        return {}

    def stop(self, *_: object) -> None:
        self._drain_asked = "SIGTERM"  # a signal handler only sets a flag; the loop drains (sockets are not reentrant)

    def drain(self, why: str) -> None:
        if self.draining_since is not None:
            return
        self.draining_since = time.monotonic()
        log.warning("%s: draining %d request(s) in flight, then exiting (at most %gs)", why, self.inflight(),
                    self.drain_timeout_s)
        for ident in self.peers:
            self.send(ident, P.DrainNotice())

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        log.info("%s worker ready on %s", self.role, self.endpoint)
        if self.join is not None:
            self.join.start(self.poller)
        while not self._stop:
            if self._parent is not None and os.getppid() != self._parent:
                log.warning("parent process exited; stopping")  # never outlive `kvseal serve`
                break
            self.hooks.refresh()
            if self.join is not None:
                self.join.tick(self.poller)  # a router that came up since joins this worker too
            if self._drain_asked is not None:
                self.drain(self._drain_asked)
            busy = self.engine.has_work() or self.busy() or self.outbox.queued > 0
            for sock, _ in self.poller.poll(0 if busy else 20):
                if sock is self.ctrl:
                    self._drain_ctrl()
                elif self.join is not None and self.join.on_readable(sock):  # refused: stop, say so on exit
                    self._stop, self.exit_code = True, EXIT_REFUSED
            try:
                self.pump()
            except Exception:  # a fault in moving KV must not end the process
                log.exception("moving KV failed")
            self.route(self.engine.take_addressed())  # e.g. a first token that arrived with its KV: not after a step
            if self.engine.has_work():
                try:
                    self._step_threads()
                    self.engine.advance()
                except Exception:
                    log.exception("engine step failed; failing its requests")
                    self.engine.fail_all(InternalError("the engine failed while running this request"))
                self.route(self.engine.take_addressed())
            elif self.lending is not None:
                self.lending.idle()  # no work: its cores may serve a sibling's steps
            for ident in self.outbox.flush():
                self._router_left(ident)
            if self.draining_since is not None and self._drained():
                break
        self.close()
        return self.exit_code

    def _step_threads(self) -> None:
        """With lending: this step runs on the worker's own share of the cores plus those of siblings with no work.
        The thread count changes no result: every product and attention row is computed in the same order on any
        number of threads (the fast arithmetic's batch invariance)."""
        if self.lending is None:
            return
        n = self.lending.take()
        if n != self._threads:
            torch.set_num_threads(n)
            if self.engine.kernels == "native":
                from kvseal.kernels.ops import set_threads

                set_threads(n)  # OpenMP's count is per thread and the kernels' runtime is not torch's
            self._threads = n
        if n > self.lending.home:
            self.counters["steps_on_lent_cores"] += 1

    def _router_left(self, ident: bytes) -> None:
        """A router is gone (the outbox gave up on it): it hears nothing more, and its requests here end."""
        self.peers.discard(ident)
        if routed := self.engine.routed_to(ident):
            log.error("router %r is gone: its %d request(s) in flight here fail", ident, len(routed))
        self.peer_lost(ident)

    def _drained(self) -> bool:
        assert self.draining_since is not None
        if self.inflight() == 0 and self.outbox.queued == 0:
            log.info("drained; exiting")
            return True
        if time.monotonic() - self.draining_since > self.drain_timeout_s:
            log.error("drain timeout (%gs): failing %d request(s) still in flight", self.drain_timeout_s,
                      self.inflight())
            self.engine.fail_all(WorkerDraining("the worker shut down before this request ended"))
            self.route(self.engine.take_addressed())
            self.outbox.flush()
            return True
        return False

    def _drain_ctrl(self) -> None:
        while True:
            try:
                frames = self.ctrl.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._refuse_frame(f"a control message of {len(frames) - 1} frames (expected 1)")
                continue
            ident, data = frames
            try:
                msg = P.decode(data)
            except Exception as exc:  # noqa: BLE001 - msgspec's errors, or anything a hostile frame provokes
                self._refuse_frame(f"a malformed control message: {exc}"[:300])
                continue
            self.peers.add(ident)
            try:
                self.handle(ident, msg)
            except KvsealError as exc:
                self.counters["frames_refused"] += 1
                log.warning("refused %s: %s", type(msg).__name__, exc.message[:300])
            except Exception:  # a handler bug must not end the process; the request fails
                log.exception("handling %s failed", type(msg).__name__)
                self.handler_failed(msg)

    def _refuse_frame(self, why: str) -> None:
        self.counters["frames_refused"] += 1
        log.warning("dropping %s", why)

    def close(self) -> None:
        if self.join is not None:
            self.join.close()
        if self.lending is not None:
            self.lending.close()
        self.ctrl.close(0)
        if self.zap is not None:
            self.zap.stop()
        self.ctx.term()
        self.engine.close()  # its grammar compilers and its ledger

    # -- role hooks ----------------------------------------------------------------------------------
    def handle(self, ident: bytes, msg: P.Message) -> None:
        match msg:
            case P.InfoReq(call_id=cid):
                self.send(ident, self.info_resp(cid))
            case P.AbortReq(request_id=rid, error=err):
                self.engine.abort(rid, KvsealError.from_info(err))
            case P.StatusReq(call_id=cid, request_id=rid):
                self.send(ident, P.StatusResp(call_id=cid, live=self.is_live(rid), sent=self.sent_deltas(rid)))
            case P.DrainReq(call_id=cid):
                self.drain(f"drain requested by {ident!r}")
                self.send(ident, P.DrainResp(call_id=cid, inflight=self.inflight()))
            case _:
                raise InvalidRequest(f"a {self.role} worker does not take {type(msg).__name__}")

    def refuse_new(self) -> None:
        """Raise while draining: a new request goes to another worker."""
        if self.draining_since is not None:
            raise WorkerDraining(f"the {self.role} worker at {self.endpoint} is draining and takes no new request")

    def handler_failed(self, msg: P.Message) -> None:
        """A handler raised unexpectedly: fail the request the message named (pages freed), if any."""
        rid = getattr(msg, "request_id", None) or getattr(getattr(msg, "request", None), "request_id", None)
        if isinstance(rid, str):
            self.engine.fail(rid, InternalError(f"the {self.role} worker failed while handling this request"))

    def inflight(self) -> int:
        return self.engine.inflight()

    def is_live(self, request_id: str) -> bool:
        return self.engine.is_live(request_id)

    def sent_deltas(self, request_id: str) -> int:
        return 0

    def busy(self) -> bool:
        return False

    def pump(self) -> None:
        """Role-specific KV movement, once per loop turn."""

    def route(self, out: list[tuple[Sequence, GenerateDelta]]) -> None:
        """Role-specific delivery of engine outputs: each delta goes where its request's route says."""

    def peer_lost(self, ident: bytes) -> None:
        """The outbox gave up on a router: fail the requests it was to receive (role-specific)."""

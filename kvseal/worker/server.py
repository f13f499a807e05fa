"""A worker process: an engine behind a ZeroMQ control socket, one thread, one loop.

Each turn of the loop: read every pending control message, let the role move KV (prefill: send and poll
handoffs; decode: receive, verify, admit), run one engine step if there is work, and route the outputs.
Messages wait at most one engine step.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import msgspec
import zmq

from kvseal import faults as faults_mod
from kvseal.engine.engine import Engine
from kvseal.engine.messages import GenerateDelta
from kvseal.errors import InternalError, InvalidRequest, KvsealError
from kvseal.faults import Faults, warn_if_on
from kvseal.launch import LAUNCHER_PID_ENV
from kvseal.worker import protocol as P

log = logging.getLogger("kvseal.worker")


class WorkerServer:
    role = "worker"

    def __init__(self, engine: Engine, bind: str, faults: Faults) -> None:
        self.engine, self.faults = engine, faults
        self.ctx = zmq.Context()
        self.ctrl: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        self.ctrl.setsockopt(zmq.LINGER, 0)
        self.ctrl.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.ctrl.bind(bind)
        self.endpoint = self.ctrl.getsockopt_string(zmq.LAST_ENDPOINT)
        self.poller = zmq.Poller()
        self.poller.register(self.ctrl, zmq.POLLIN)
        self._stop = False
        # set by `kvseal serve` (launch.Fleet) for the workers it starts: never outlive that process, even one
        # that died while this worker was still loading its model. A worker started on its own has no parent.
        launcher = os.environ.get(LAUNCHER_PID_ENV)
        self._parent = int(launcher) if launcher else None
        self.counters: dict[str, int] = {"kv_bytes_sent": 0, "kv_bytes_received": 0, "transfers_acked": 0,
                                         "transfers_refused": 0, "requests_received": 0}

    # -- plumbing ---------------------------------------------------------------------------------------
    def send(self, ident: bytes, msg: P.Message) -> None:
        try:
            self.ctrl.send_multipart([ident, P.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the router went away; its requests end by their own timeouts
            log.warning("could not answer %r: %s", ident, exc)

    def info(self) -> dict[str, Any]:
        return {**self.engine.info(), **self.counters, "control_endpoint": self.endpoint,
                "model_window": min(self.engine.arch.max_position,
                                    self.engine.cfg.model.max_model_len or self.engine.arch.max_position)}

    def stop(self, *_: object) -> None:
        self._stop = True

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        log.info("%s worker ready on %s", self.role, self.endpoint)
        while not self._stop:
            if self._parent is not None and os.getppid() != self._parent:
                log.warning("parent process exited; stopping")  # never outlive `kvseal serve`
                break
            busy = self.engine.has_work() or self.busy()
            for sock, _ in self.poller.poll(0 if busy else 20):
                if sock is self.ctrl:
                    self._drain_ctrl()
            self.pump()
            if self.engine.has_work():
                try:
                    out = self.engine.step()
                except Exception:
                    log.exception("engine step failed; failing its requests")
                    out = self.engine.fail_all(InternalError("the engine failed while running this request"))
                self.route(out)
        self.close()

    def _drain_ctrl(self) -> None:
        while True:
            try:
                ident, data = self.ctrl.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue
            try:
                msg = P.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("dropping a malformed control message: %s", exc)
                continue
            try:
                self.handle(ident, msg)
            except KvsealError as exc:
                log.warning("refused %s: %s", type(msg).__name__, exc)

    def close(self) -> None:
        self.ctrl.close(0)
        self.ctx.term()

    # -- role hooks ----------------------------------------------------------------------------------
    def handle(self, ident: bytes, msg: P.Message) -> None:
        match msg:
            case P.InfoReq(call_id=cid):
                self.send(ident, P.InfoResp(call_id=cid, info=self.info()))
            case P.AbortReq(request_id=rid, error=err):
                self.engine.abort(rid, KvsealError.from_info(err))
            case P.SetFaultsReq(call_id=cid, spec=spec):
                if "control" not in self.faults.flags:
                    raise InvalidRequest("fault injection is off in this worker")
                self.faults = faults_mod.parse(spec + ",control")
                warn_if_on(self.faults, f"kvseal {self.role}")
                self.send(ident, P.InfoResp(call_id=cid, info=self.info()))
            case _:
                raise InvalidRequest(f"a {self.role} worker does not take {type(msg).__name__}")

    def busy(self) -> bool:
        return False

    def pump(self) -> None:
        """Role-specific KV movement, once per loop turn."""

    def route(self, out: list[GenerateDelta]) -> None:
        """Role-specific delivery of engine outputs."""


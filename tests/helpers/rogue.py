"""The rogue decode worker of issue 17, section 1, as an attacker with one tenant's API key wrote it: bind a
ZeroMQ socket, ask the router's fleet socket to admit it as a decode worker, answer the router's InfoReq with a
copied decode worker's info, and record every request the router then sends it (its prompt token ids are other
tenants' prompts). It answers reservations "draining", so the router retries elsewhere and the victims see
nothing. Test code only; nothing here runs in kvseal."""

from __future__ import annotations

import threading
from typing import Any

import zmq

from kvseal.errors import WorkerDraining
from kvseal.wire import protocol as P
from kvseal.wire.card import WorkerCard


class RogueDecode:
    def __init__(self, copied_info: dict[str, Any]) -> None:
        self.ctx = zmq.Context()
        self.sock: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        # the copied card, as the copy gives it (None: nothing copied; it then answers no info request)
        self.card = WorkerCard.from_json({**copied_info, "instance": "rogue"}) if copied_info else None
        self.figures = {**copied_info, "control_endpoint": self.endpoint}
        self.frames = 0  # every frame the router sent it, of any kind
        self.prompts: list[list[int]] = []  # the prompt ids of every request routed here
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, data = self.sock.recv_multipart()[:2]
            self.frames += 1
            msg = P.decode(data)
            if isinstance(msg, P.InfoReq) and self.card is not None:
                self.sock.send_multipart([ident, P.encode(P.InfoResp(call_id=msg.call_id, card=self.card,
                                                                     draining=False, figures=self.figures))])
            elif isinstance(msg, P.ReserveReq):
                self.prompts.append(list(msg.request.prompt_ids))
                err = WorkerDraining("draining").to_info()
                self.sock.send_multipart([ident, P.encode(P.ReserveResp(call_id=msg.call_id, error=err))])

    def join(self, fleet_endpoint: str, timeout_s: float, keys: Any = None, server_key: str | None = None) -> Any:
        """Send a JoinReq naming this socket; the router's answer (a JoinResp), or None if none came."""
        sock: zmq.Socket[bytes] = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:  # a CURVE client with a key of its own and a guessed server key
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public.encode())
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret.encode())
            sock.setsockopt(zmq.CURVE_SERVERKEY, (server_key or "").encode())
        try:
            sock.connect(fleet_endpoint if "://" in fleet_endpoint else f"tcp://{fleet_endpoint}")
            sock.send(P.encode(P.JoinReq(call_id=1, role="decode", endpoint=self.endpoint)))
            return P.decode(sock.recv()) if sock.poll(int(timeout_s * 1000)) else None
        finally:
            sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()

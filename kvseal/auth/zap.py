"""The ZAP handler (ZeroMQ RFC 27) of one ZeroMQ context: it lets a CURVE client finish its handshake with a
server socket of that context only when the client's public key is on the member's allow-list.

libzmq asks it during the handshake, before the connection exists for the socket: a refused peer never gets a
frame read, queued or answered (the client sees HANDSHAKE_FAILED_AUTH and libzmq stops reconnecting). An
accepted peer's messages carry its public key as the `User-Id` property (`frame.get("User-Id")`), which is how
the router learns the key of a worker that joins.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from typing import Any

import zmq
import zmq.utils.z85

from kvseal.auth.keys import MemberKeys

USER = b"kvseal-kv"  # the KV channel's PLAIN user name (kvseal/transfer/kvmac.py)

log = logging.getLogger("kvseal.auth")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DOMAIN = b"kvseal"
_LOG_EVERY_S = 5.0  # one log line per this many seconds of refusals (a peer retrying must not flood the log)


class ZapHandler:
    """A thread answering ZAP requests for `ctx` (a plain or asyncio context). Start it before any server
    socket of the context binds; stop it before the context terminates."""

    def __init__(self, ctx: zmq.Context[Any], keys: MemberKeys, what: str, token: bytes | None = None) -> None:
        self.keys, self.what = keys, what
        self.token = token  # PLAIN: the KV channel's session token (kvseal/transfer/kvmac.py), if it has one
        self.refused = 0  # handshakes refused (a key not on the allow-list, or not CURVE)
        self.accepted = 0
        self._base: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(ctx.underlying)
        self._stop_ep = f"inproc://kvseal-zap-stop-{secrets.token_hex(6)}"
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._logged_at, self._unlogged = 0.0, 0
        self._thread = threading.Thread(target=self._run, name=f"zap-{what}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            raise RuntimeError(f"cannot start the fleet authenticator of the {what}: {self._failed}")
        self._stop: zmq.Socket[bytes] = self._base.socket(zmq.PAIR)
        self._stop.setsockopt(zmq.LINGER, 0)
        self._stop.connect(self._stop_ep)

    def allows(self, public: str) -> bool:
        try:
            return self.keys.admits(public)
        except ValueError as exc:
            log.error("fleet allow-list unreadable, refusing: %s", exc)
            return False

    def _run(self) -> None:
        try:
            rep = self._base.socket(zmq.REP)
            rep.setsockopt(zmq.LINGER, 0)
            rep.bind(ZAP_ENDPOINT)
            stop = self._base.socket(zmq.PAIR)
            stop.setsockopt(zmq.LINGER, 0)
            stop.bind(self._stop_ep)
        except zmq.ZMQError as exc:
            self._failed = exc
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(rep, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if stop in ready:
                    return
                if rep in ready:
                    rep.send_multipart(self._answer(rep.recv_multipart()))
        finally:
            rep.close(0)
            stop.close(0)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        # request: version, request id, domain, address, routing id, mechanism, credentials...
        if len(frames) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, _domain, address, _rid, mechanism = frames[:6]
        if (mechanism == b"PLAIN" and self.token is not None and len(frames) == 8 and frames[6] == USER
                and hmac.compare_digest(frames[7], self.token)):
            self.accepted += 1
            return [version, request_id, b"200", b"OK", b"kv-session", b""]
        client = frames[6] if mechanism == b"CURVE" and len(frames) == 7 and len(frames[6]) == 32 else None
        public = zmq.utils.z85.encode(client).decode() if client is not None else ""
        if client is not None and self.allows(public):
            self.accepted += 1
            return [version, request_id, b"200", b"OK", public.encode(), b""]
        self.refused += 1
        self._log_refusal(address.decode(errors="replace"), mechanism.decode(errors="replace"), public)
        return [version, request_id, b"400", b"not a member of this fleet", b"", b""]

    def _log_refusal(self, address: str, mechanism: str, public: str) -> None:
        now = time.monotonic()
        if now - self._logged_at < _LOG_EVERY_S:
            self._unlogged += 1
            return
        more = f" (and {self._unlogged} more since the last line)" if self._unlogged else ""
        log.warning("refused a connection to the %s from %s: %s%s", self.what, address,
                    f"its key {public} is not on the fleet allow-list" if public else
                    f"no valid {mechanism} credentials",
                    more)
        self._logged_at, self._unlogged = now, 0

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stop.send(b"")
            self._thread.join(5.0)
        self._stop.close(0)

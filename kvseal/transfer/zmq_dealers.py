"""A KV sender's connections (transfer/zmq.py): one DEALER per receiver endpoint, opened with the credentials the
receiver's reservation named (its pinned CURVE key, or its MAC session), and reopened when they change (another
receiver now owns that endpoint). With fleet keys nothing is sent to a receiver whose key is not on this worker's
allow-list (seal 9)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvseal.auth.curve import as_client
from kvseal.auth.keys import MemberKeys
from kvseal.auth.zap import USER
from kvseal.transfer.kvmac import KvMac


def kv_socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, hwm: int, keepalive_idle_s: int) -> zmq.Socket[bytes]:
    """A KV socket: no linger, `hwm` whole transfers queued per peer and direction, TCP keepalive (a peer that
    vanished is noticed within keepalive_idle_s + 15 s)."""
    s: zmq.Socket[bytes] = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, hwm)
    s.setsockopt(zmq.RCVHWM, hwm)
    s.setsockopt(zmq.TCP_KEEPALIVE, 1)
    s.setsockopt(zmq.TCP_KEEPALIVE_IDLE, keepalive_idle_s)
    s.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 5)
    s.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
    return s


@dataclass(frozen=True, slots=True)
class _Dealer:
    sock: zmq.Socket[bytes]
    creds: tuple[str | None, str | None]  # (the receiver's pinned key, its MAC session)
    mac: KvMac | None  # the receiver's MAC framing (a session was given)


class Dealers:
    def __init__(self, socket: Callable[[int], zmq.Socket[bytes]], keys: MemberKeys | None) -> None:
        self._socket, self.keys = socket, keys
        self._by_endpoint: dict[str, _Dealer] = {}

    def open(self, endpoint: str, server_key: str | None, session: str | None) -> zmq.Socket[bytes]:
        """The DEALER to `endpoint` with these credentials; PermissionError when the receiver's key is not on
        the allow-list."""
        d = self._by_endpoint.get(endpoint)
        if d is not None and d.creds == (server_key, session):
            return d.sock
        if d is not None:
            d.sock.close(0)  # another receiver now owns that endpoint: a new connection, with its credentials
            del self._by_endpoint[endpoint]
        if self.keys is not None and not (server_key and self.keys.admits(server_key)):
            raise PermissionError(f"the KV receiver at {endpoint} names no fleet key on this worker's allow-list "
                                  f"({server_key or 'none'}): nothing is sent to it")
        sock, mac = self._socket(zmq.DEALER), None
        if self.keys is not None and session:  # the receiver's MAC framing: its token, then a tag per message
            mac = KvMac(session)
            sock.setsockopt(zmq.PLAIN_USERNAME, USER)
            sock.setsockopt(zmq.PLAIN_PASSWORD, mac.token)
        else:
            as_client(sock, self.keys, server_key, f"decode worker's KV port at {endpoint}")
        sock.connect(endpoint)
        self._by_endpoint[endpoint] = _Dealer(sock, (server_key, session), mac)
        return sock

    def get(self, endpoint: str) -> zmq.Socket[bytes] | None:
        d = self._by_endpoint.get(endpoint)
        return None if d is None else d.sock

    def mac(self, endpoint: str) -> KvMac | None:
        d = self._by_endpoint.get(endpoint)
        return None if d is None else d.mac

    def close(self) -> None:
        for d in self._by_endpoint.values():
            d.sock.close(0)
        self._by_endpoint.clear()

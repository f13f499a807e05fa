"""A worker started with `--router HOST:PORT` asks that router to admit it: every router HOST names.

HOST may resolve to several addresses (a headless Service over the routers' pods, issue 34): the worker joins each
one (`Registrations`), and resolves the name again every RESOLVE_S seconds, so a router that comes up later (a
new replica, a restarted pod) gets it too. Each router checks it in full on its own.

The router checks the worker in full (seal 7, router/registry.py) before it sends it a request: the same check as
at the router's start and at every reconnect. A refusal carries the reason, which this worker logs before it
exits with EXIT_REFUSED; the router keeps showing the refused worker and the reason in its /info.
With fleet keys the join is a CURVE client pinned to the router's key: the router reads the JoinReq only when
this worker's key is on its allow-list, and the router then connects to this worker pinning that same key.
"""

from __future__ import annotations

import logging
import socket
import time
from urllib.parse import urlsplit

import msgspec
import zmq

from kvseal.auth.curve import as_client
from kvseal.auth.keys import MemberKeys
from kvseal.wire import protocol as P
from kvseal.wire.roles import Role

log = logging.getLogger("kvseal.worker")
EXIT_REFUSED = 3  # the process's exit status when the router refuses this worker
RESOLVE_S = 10.0  # how often the router's name is resolved again (new routers join the fleet)


class Registration:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], router: str, role: Role, endpoint: str,
                 keys: MemberKeys | None = None, router_key: str | None = None) -> None:
        self.router, self.role, self.endpoint = router, role, endpoint
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        as_client(self.sock, keys, router_key, f"router's fleet port at {router}")
        # with keys: a router that refuses this worker's key ends the handshake with an auth failure
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH) if keys is not None else None
        self.accepted = False

    def start(self, poller: zmq.Poller) -> None:
        """Connect and ask once: ZeroMQ holds the request until the router is up."""
        self.sock.connect(self.router)
        self.sock.send(P.encode(P.JoinReq(call_id=1, role=self.role, endpoint=self.endpoint)))
        poller.register(self.sock, zmq.POLLIN)
        if self.monitor is not None:
            poller.register(self.monitor, zmq.POLLIN)
        log.info("asked the router at %s to admit this %s worker (%s)", self.router, self.role, self.endpoint)

    def on_readable(self, sock: zmq.Socket[bytes]) -> bool:
        """Read the router's verdict; True when this worker was refused: it stops and exits with EXIT_REFUSED."""
        if self.monitor is not None and sock is self.monitor:
            self.monitor.recv_multipart()
            log.error("the router at %s refused this worker's fleet key at the handshake: it is not on the router's "
                      "allow-list (copy this member's public key into the router's --fleet-keys DIR/public)",
                      self.router)
            return True
        if sock is not self.sock:
            return False
        try:
            msg = P.decode(self.sock.recv(zmq.NOBLOCK))
        except (zmq.Again, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("unreadable answer from the router at %s: %s", self.router, exc)
            return False
        if not isinstance(msg, P.JoinResp):
            log.warning("the router at %s answered %s to a join", self.router, type(msg).__name__)
            return False
        if msg.accepted:
            self.accepted = True
            log.info("the router at %s admitted this worker (context window %d tokens)", self.router,
                     msg.context_window)
            return False
        log.error("the router at %s refused this worker: %s", self.router, msg.reason)
        return True

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(0)
        self.sock.close(0)


class Registrations:
    """A Registration per address the router's name resolves to, kept in step with the name (RESOLVE_S)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], router: str, role: Role, endpoint: str,
                 keys: MemberKeys | None = None, router_key: str | None = None) -> None:
        self.ctx, self.router, self.role, self.endpoint = ctx, router, role, endpoint
        self.keys, self.router_key = keys, router_key
        self.joined: dict[str, Registration] = {}  # tcp://ADDRESS:PORT -> its join
        self._resolved_at = 0.0

    def start(self, poller: zmq.Poller) -> None:
        self.tick(poller)

    def tick(self, poller: zmq.Poller) -> None:
        """Join any router address the name resolves to now that this worker has not joined yet."""
        now = time.monotonic()
        if now - self._resolved_at < RESOLVE_S and self.joined:
            return
        self._resolved_at = now
        for address in addresses(self.router):
            if address not in self.joined:
                join = Registration(self.ctx, address, self.role, self.endpoint, self.keys, self.router_key)
                join.start(poller)
                self.joined[address] = join

    def on_readable(self, sock: zmq.Socket[bytes]) -> bool:
        return any(join.on_readable(sock) for join in self.joined.values())

    def close(self) -> None:
        for join in self.joined.values():
            join.close()


def addresses(router: str) -> list[str]:
    """tcp://HOST:PORT -> tcp://ADDRESS:PORT for every IPv4 address HOST has (itself when it does not resolve:
    ZeroMQ keeps trying it)."""
    parts = urlsplit(router)
    host, port = parts.hostname, parts.port
    if host is None or port is None:
        return [router]
    try:
        found = sorted({info[4][0] for info in socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)})
    except OSError:
        return [router]
    return [f"tcp://{a}:{port}" for a in found] or [router]

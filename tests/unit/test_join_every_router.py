"""A worker started with --router NAME:PORT joins every router NAME resolves to (worker/join.py, issue 34): a
headless Service over the routers' pods gives one address per pod. Two real ZeroMQ fleet sockets on two loopback
addresses stand in for two routers; the name's resolution is the test's."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
import zmq

from kvseal.wire import protocol as P
from kvseal.wire.roles import Role
from kvseal.worker import join as J
from tests.helpers.procs import free_port


def test_a_worker_joins_every_address_of_the_routers_name_and_later_ones_too(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    routers = {}
    for address in ("127.0.0.1", "127.0.0.2"):
        s = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(f"tcp://{address}:{port}")
        routers[address] = s
    resolved = ["127.0.0.1"]

    def getaddrinfo(host: str, p: Any, *args: Any, **kw: Any) -> list[Any]:
        assert host == "kvseal-fleet.kvseal.svc" and p == port
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in resolved]

    monkeypatch.setattr(J.socket, "getaddrinfo", getaddrinfo)
    joins = J.Registrations(ctx, f"tcp://kvseal-fleet.kvseal.svc:{port}", Role.DECODE, "tcp://127.0.0.1:9")
    poller = zmq.Poller()
    try:
        joins.start(poller)
        assert isinstance(P.decode(_recv(routers["127.0.0.1"])), P.JoinReq)
        resolved.append("127.0.0.2")  # a second router replica comes up
        monkeypatch.setattr(J, "RESOLVE_S", 0.0)
        joins.tick(poller)
        msg = P.decode(_recv(routers["127.0.0.2"]))
        assert isinstance(msg, P.JoinReq) and msg.role == Role.DECODE and msg.endpoint == "tcp://127.0.0.1:9"
        joins.tick(poller)
        assert sorted(joins.joined) == [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.2:{port}"]  # once each
    finally:
        joins.close()
        for s in routers.values():
            s.close(0)
        ctx.term()


def test_a_name_that_does_not_resolve_is_kept_as_given() -> None:
    assert J.addresses("tcp://no-such-host.invalid:7100") == ["tcp://no-such-host.invalid:7100"]
    assert J.addresses("tcp://127.0.0.1:7100") == ["tcp://127.0.0.1:7100"]


def _recv(sock: zmq.Socket[bytes], timeout: float = 10.0) -> bytes:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sock.poll(100):
            return sock.recv_multipart()[-1]
    raise AssertionError("no join arrived")

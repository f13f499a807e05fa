"""A worker never drops output silently: what ZeroMQ cannot take now waits in order, and a router that is gone or
reads nothing for too long is given up (so the worker fails its requests), with real sockets on loopback."""

from __future__ import annotations

import time

import zmq

from kvseal.worker.outbox import Outbox


def _pair(hwm: int) -> tuple[zmq.Context, zmq.Socket, zmq.Socket, bytes]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, hwm)
    router.setsockopt(zmq.SNDBUF, 4096)
    router.bind("tcp://127.0.0.1:*")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, hwm)
    dealer.setsockopt(zmq.RCVBUF, 4096)
    dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    dealer.send(b"hello")
    ident, _ = router.recv_multipart()
    return ctx, router, dealer, ident


def test_a_slow_reader_gets_everything_in_order() -> None:
    ctx, router, dealer, ident = _pair(hwm=2)
    box = Outbox(router, give_up_s=30)
    payload = b"x" * 65536
    for i in range(200):  # far more than the queues and buffers hold while the dealer reads nothing
        box.send(ident, i.to_bytes(4, "big") + payload)
    assert box.queued > 0  # ZeroMQ refused some: they wait here instead of being dropped
    got: list[int] = []
    deadline = time.monotonic() + 30
    while len(got) < 200 and time.monotonic() < deadline:
        assert box.flush() == set()
        while dealer.poll(10):
            got.append(int.from_bytes(dealer.recv()[:4], "big"))
    assert got == list(range(200))
    assert box.queued == 0
    for s in (router, dealer):
        s.close(0)
    ctx.term()


def test_a_router_that_reads_nothing_or_is_gone_is_given_up() -> None:
    ctx, router, dealer, ident = _pair(hwm=2)
    box = Outbox(router, give_up_s=0.2)
    for _ in range(200):
        box.send(ident, b"y" * 65536)
    assert box.queued > 0
    time.sleep(0.3)
    assert box.flush() == {ident} and box.queued == 0  # its requests fail on the worker's side
    box.send(b"no-such-router", b"z")  # EHOSTUNREACH: gone at once
    assert box.flush() == {b"no-such-router"}
    for s in (router, dealer):
        s.close(0)
    ctx.term()

"""`kvseal drain [NAME@]HOST:PORT`: ask a worker to drain (as on SIGTERM): it takes no new request, finishes those
in flight, then exits. An admin tool, like those of tools.py: its flags are its own."""

from __future__ import annotations

import argparse
import sys
import time

from kvseal.auth.options import add_fleet_key_args, member_keys, peer
from kvseal.cli.base import Subparsers, command


def add_parser(sub: Subparsers[argparse.ArgumentParser]) -> None:
    p = command(sub, "drain", "drain a worker: it takes no new request, finishes those in flight, then exits "
                "(as on SIGTERM)")
    p.add_argument("worker", metavar="[NAME@]HOST:PORT",
                   help="the worker's control endpoint; with --fleet-keys, NAME is its member")
    add_fleet_key_args(p)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the worker's answer")
    p.set_defaults(func=cmd_drain)


def cmd_drain(a: argparse.Namespace) -> int:
    """Ask a worker to drain: it takes no new request, finishes those in flight, then exits."""
    import zmq

    from kvseal.auth.curve import as_client
    from kvseal.wire import protocol as P

    keys = member_keys(a, "drain")
    endpoint, key = peer(a, a.worker, keys, None)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        as_client(sock, keys, key, f"worker at {a.worker}")
        sock.connect(endpoint)
        sock.send(P.encode(P.DrainReq(call_id=1)))
        deadline = time.monotonic() + a.timeout
        resp: P.Message | None = None
        while not isinstance(resp, P.DrainResp):  # the worker tells every peer it drains: skip that notice
            if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                print(f"kvseal drain: {a.worker} did not answer within {a.timeout:g}s", file=sys.stderr)
                return 1
            resp = P.decode(sock.recv())
    finally:
        sock.close(0)
        ctx.term()
    print(f"{a.worker} is draining: {resp.inflight} request(s) to finish, then it exits")
    return 0

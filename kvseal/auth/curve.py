"""CURVE on a ZeroMQ socket, both ways: a server proves its key to every client and takes only allow-listed
clients (through the context's ZapHandler); a client pins the one server key it expects, so a rogue process that
binds the port a member connects to completes no handshake and gets no frame.

Who binds and who connects (each pair authenticates both ends):
    router DEALER  -> worker control ROUTER      the router pins the worker's key; the worker allow-lists the router
    worker DEALER  -> router fleet ROUTER        the worker pins the router's key; the router allow-lists the worker
    prefill DEALER -> decode KV ROUTER           prefill pins decode's key (from the reservation); decode allow-lists
                                                 prefill. NIXL's offer (agent metadata, page ids) travels here too.
Without keys (loopback only, with a warning) every socket is plain ZeroMQ (the NULL mechanism).
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any

import zmq

from kvseal.auth.keys import MemberKeys
from kvseal.auth.zap import DOMAIN

log = logging.getLogger("kvseal.auth")


def as_server(sock: zmq.Socket[Any], keys: MemberKeys | None) -> None:
    """Before bind: with keys, CURVE server with this member's keypair; every client must pass the context's ZAP
    handler (ZAP_ENFORCE_DOMAIN: no handler means no connection, never an open door)."""
    if keys is None:
        return
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public.encode())
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret.encode())
    sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def as_plain_server(sock: zmq.Socket[Any]) -> None:
    """Before bind: ZeroMQ PLAIN, checked by the context's ZAP handler (the KV channel's session token,
    kvseal/transfer/kvmac.py); no handler means no connection."""
    sock.setsockopt(zmq.PLAIN_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def as_client(sock: zmq.Socket[Any], keys: MemberKeys | None, server_key: str | None, what: str) -> None:
    """Before connect: with keys, CURVE client with this member's keypair, pinned to `server_key`."""
    if keys is None:
        return
    if not server_key:
        raise ValueError(f"no fleet key is known for the {what}: name its member as NAME@HOST:PORT (its public key "
                         f"is --fleet-keys DIR/public/NAME.key)")
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public.encode())
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret.encode())
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_key.encode())


def is_loopback(host: str) -> bool:
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False  # a name or an interface: it may be reachable from elsewhere


def check_bind(host: str, keys: MemberKeys | None, what: str, flag: str) -> None:
    """Refuse a fleet port off loopback without keys (ValueError naming the fix); warn on loopback without."""
    if keys is not None:
        return
    if not is_loopback(host):
        raise ValueError(
            f"invalid {flag}={host!r} for the {what} without fleet keys: anyone who reaches {host} could join the "
            f"fleet and read other tenants' prompts. Run `kvseal keys DIR` once and start every role with "
            f"--fleet-keys DIR --fleet-member NAME (kvseal serve makes its own keys unless --fleet-keys off), or "
            f"bind {flag} 127.0.0.1")
    log.warning("the %s on %s has no fleet keys: any process on this host can connect to it; give --fleet-keys to "
                "authenticate and encrypt the fleet", what, host)

"""The command line of fleet keys: `kvseal keys DIR [NAME ...]`, `--fleet-keys DIR` / `--fleet-member NAME` on
every role, and peers named `NAME@HOST:PORT` (the member whose public key a connection pins)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvseal.auth.keys import MemberKeys, fresh_member, load_member, public_key, write_key_set

DEFAULT_MEMBERS = ("router", "prefill", "decode")


def add_fleet_key_args(p: argparse.ArgumentParser, serve: bool = False) -> None:
    if serve:
        p.add_argument("--fleet-keys", default=None, metavar="DIR|off",
                       help="authenticate and encrypt the fleet (ZeroMQ CURVE). Default: fresh keys for this "
                            "command's own processes, made in memory; DIR: the router's keys from a `kvseal keys` "
                            "set, whose public/ folder also admits workers that join with --router; off: plain "
                            "ZeroMQ, loopback only")
    else:
        p.add_argument("--fleet-keys", default=None, metavar="DIR",
                       help="a `kvseal keys` set: this process's keypair (DIR/private/NAME.key_secret) and the "
                            "fleet's allow-list (DIR/public/*.key). Every socket of the fleet is then "
                            "authenticated both ways and encrypted (ZeroMQ CURVE). Without it: plain ZeroMQ, on "
                            "loopback only")
    p.add_argument("--fleet-member", default=None, metavar="NAME",
                   help="this process's member name in --fleet-keys (default: its role: router, prefill, decode)")


def add_keys_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser("keys", help="write a fleet key set: one CURVE keypair per member (files 0600)",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    keys.add_argument("dir", metavar="DIR", help="the key set's folder (created 0700; members are added to it)")
    keys.add_argument("names", nargs="*", metavar="NAME", default=list(DEFAULT_MEMBERS),
                      help="members to make keys for, e.g. router prefill-1 prefill-2 decode-1")
    keys.set_defaults(func=cmd_keys)


def cmd_keys(a: argparse.Namespace) -> int:
    written = write_key_set(a.dir, list(a.names))
    for p in written:
        print(p)
    root = Path(a.dir)
    print(f"\n{len(a.names)} member(s). Copy {root / 'public'}/ to every host of the fleet (the allow-list: deleting "
          f"NAME.key there revokes NAME); copy {root / 'private'}/NAME.key_secret only to the host that runs NAME, "
          f"and start it with --fleet-keys DIR --fleet-member NAME. Peers are named NAME@HOST:PORT.")
    return 0


def member_keys(a: argparse.Namespace, role: str) -> MemberKeys | None:
    """This process's keys: None without --fleet-keys (or `off`); `kvseal serve` makes fresh ones by default."""
    if a.fleet_keys == "off":
        return None
    if a.fleet_keys is None:
        return fresh_member() if a.command == "serve" else None
    return load_member(a.fleet_keys, a.fleet_member or role)


def peer(a: argparse.Namespace, spec: str, keys: MemberKeys | None, default_name: str | None) -> tuple[str, str | None]:
    """`[NAME@]HOST:PORT` -> (tcp endpoint, NAME's public key when this process has fleet keys)."""
    name, at, _ = spec.rpartition("@")
    endpoint = peer_endpoint(spec)
    if keys is None:
        return endpoint, None
    name = name if at else (default_name or "")
    if not name:
        raise ValueError(f"invalid peer {spec!r}: with --fleet-keys name the member whose key it holds, as "
                         f"NAME@HOST:PORT")
    if keys.allowed_dir is None:
        raise ValueError(f"invalid peer {spec!r}: its key is looked up in --fleet-keys DIR/public; give --fleet-keys")
    return endpoint, public_key(str(Path(keys.allowed_dir).parent), name)


def peer_endpoint(spec: str) -> str:
    """`[NAME@]HOST:PORT` -> its tcp endpoint."""
    hostport = spec.rpartition("@")[2]
    return hostport if "://" in hostport else f"tcp://{hostport}"

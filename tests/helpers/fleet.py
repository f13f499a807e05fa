"""A prefill worker, a decode worker and a router on loopback: the fleet most integration tests start once per
module (start-up costs seconds of CPU per worker; tests share it and leave it at baseline)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from tests.helpers.procs import Proc, Server, Worker

F = TypeVar("F", bound="LoopbackFleet")


class LoopbackFleet:
    def __init__(self, args: list[str], prefill: list[str] | None = None, decode: list[str] | None = None,
                 router: list[str] | None = None) -> None:
        self.prefill = Worker("prefill", [*args, *(prefill or [])]).ready()
        self.decode = Worker("decode", [*args, *(decode or [])]).ready()
        self.extra: list[Proc] = []  # more processes the tests started; stopped with the fleet
        self.router = Server(["--prefill", self.prefill.endpoint, "--decode", self.decode_endpoint(),
                              *(router or [])], command="router").ready()

    def decode_endpoint(self) -> str:
        """Where the router reaches the decode worker (a subclass may put something in between)."""
        return self.decode.endpoint

    def at_baseline(self) -> bool:
        """Every page free on both workers, no reservation, nothing running or waiting (seal 8)."""
        p, d = self.prefill.info(), self.decode.info()
        return (p["free_pages"] == p["pool_pages"] and d["free_pages"] == d["pool_pages"] and d["reservations"] == 0
                and p["running"] == p["waiting"] == d["running"] == d["waiting"] == 0)

    def stop(self) -> None:
        for proc in (self.router, self.prefill, self.decode, *self.extra):
            proc.stop()


@contextmanager
def running(make: type[F]) -> Iterator[F]:
    fleet = make()
    try:
        yield fleet
    finally:
        fleet.stop()

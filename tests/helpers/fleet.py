"""A prefill worker, a decode worker and a router on loopback: the fleet most integration tests start once per
module (start-up costs seconds of CPU per worker; tests share it and leave it at baseline).

A module subclasses LoopbackFleet with its flags and takes its fixture from here: `fleet = module_fleet(Fleet)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import openai
import pytest

from tests.helpers.procs import FaultFile, Proc, Server, Worker

F = TypeVar("F", bound="LoopbackFleet")


class LoopbackFleet:
    def __init__(self, args: list[str], prefill: list[str] | None = None, decode: list[str] | None = None,
                 router: list[str] | None = None, faults: bool = False) -> None:
        # with faults: the whole fleet runs with the same (runtime-changeable) test faults, `self.faults.set`
        self.faults = FaultFile() if faults else None
        shared = self.faults.args() if self.faults else []
        self.extra: list[Proc] = []  # more processes the tests started; stopped with the fleet
        started: list[Proc] = []
        try:  # a fleet that never forms stops what it started (a router left behind would run on for ever)
            self.prefill = Worker("prefill", [*args, *(prefill or []), *shared])
            started.append(self.prefill)
            self.prefill.ready()
            self.decode = Worker("decode", [*args, *(decode or []), *shared])
            started.append(self.decode)
            self.decode.ready()
            self.router = Server(["--prefill", self.prefill.endpoint, "--decode", self.decode_endpoint(),
                                  *(router or []), *shared], command="router")
            started.append(self.router)
            self.router.ready()
        except BaseException:
            for proc in started:
                proc.stop()
            if self.faults is not None:
                self.faults.remove()
            raise
        self.client = openai.OpenAI(base_url=self.router.url + "/v1", api_key="x", max_retries=0, timeout=300)

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
        if self.faults is not None:
            self.faults.remove()


@contextmanager
def running(make: Callable[[], F]) -> Iterator[F]:
    fleet = make()
    try:
        yield fleet
    finally:
        fleet.stop()


def module_fleet(make: Callable[[], F]) -> Any:
    """The module-scoped `fleet` fixture: one fleet for the module's tests, stopped after the last."""

    @pytest.fixture(scope="module")
    def fleet() -> Iterator[F]:
        with running(make) as f:
            yield f

    return fleet

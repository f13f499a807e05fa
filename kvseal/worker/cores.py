"""Cores lent between the workers that `kvseal serve` starts on one host.

Each worker has a home share of the host's cores: its threads (the cores split evenly among the workers, or the
flags). A worker with work borrows the home cores of every sibling that has had none for LEND_AFTER_S, so a lone
long prompt is prefilled on every core and a lone stream decodes on every core, while under load (every worker
busy) each keeps its own share and no two workers spin on one core. A lender that gets work again takes its cores
back at once; the borrower gives them up at its next step, so for at most one step of the borrower the host runs
more threads than cores. A worker borrows only cores that no busy worker uses (the threads in use are in the
table): where the home shares already add up to more than the cores (`--threads`, or more workers than cores),
lending adds no thread.

The table has a row a worker (busy, lent to, threads in use, idle since) in a memfd that launch.Fleet made and
handed to each worker (`LendSpec.path`: its /proc/self/fd path, which each opens again to hold a file description
of its own). Every read and write of the table happens under an exclusive POSIX record lock (one process at a
time), so a core is never lent to two workers, and a worker that dies releases the lock with its process. A dead
worker's slot keeps what it last said: if it died busy its threads stay counted as in use and its cores are never
lent; cores it had borrowed go back to their owners when they next have work (a lender always takes its cores
back).
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
from collections.abc import Callable

import msgspec

IDLE, BUSY = 0, 1
NOBODY = 0  # lent-to byte: 0 nobody, else the borrower's slot + 1
RECORD = struct.Struct("<BBHd")  # a worker's row: busy, lent to, threads in use, idle since (CLOCK_MONOTONIC s)
REC = RECORD.size
# A worker's cores are lent only once it has had no work for this long. Under load the workers' idle gaps are
# shorter, so a borrower's step rarely runs when the lender comes back: the step that does runs on more threads
# than cores, its waiting threads spinning on the core the lender needs (measured on the bundled model at 32
# streams: TTFT p50 2.3 s lending at once, 0.9 s without lending; docs/benchmarks.md). A lone request waits for
# it once: a stream's first half second of decode runs on its own threads.
LEND_AFTER_S = 0.5


class LendSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's place in the host's lending table (WorkerSpec.lend; None: no lending)."""

    path: str  # the table: /proc/self/fd/N of the memfd launch.Fleet passed down, or a file (tests)
    slot: int  # this worker's row
    homes: tuple[int, ...]  # every worker's home threads, by slot
    cores: int  # the host's cores: no step runs more threads than this

    def __post_init__(self) -> None:
        if not self.homes or any(h < 1 for h in self.homes):
            raise ValueError(f"invalid lending homes={self.homes!r}: every worker has at least one thread")
        if not 0 <= self.slot < len(self.homes):
            raise ValueError(f"invalid lending slot={self.slot} for {len(self.homes)} workers")
        if self.cores < 1:
            raise ValueError(f"invalid lending cores={self.cores}: give at least 1")


def new_table(workers: int) -> int:
    """A zeroed table for `workers` workers (all idle, nothing lent): a memfd, inheritable by children."""
    fd = os.memfd_create("kvseal-cores", 0)  # 0: no MFD_CLOEXEC, so Popen(pass_fds=) can hand it down
    os.ftruncate(fd, REC * workers)
    return fd


class CoreLending:
    """This worker's side of the table: `take()` before each step (the threads it may use), `idle()` when it has
    no work. Only the worker's stepping thread calls them."""

    def __init__(self, spec: LendSpec, share: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        """share=False: this worker neither lends nor borrows (its slot says busy for good): for an engine whose
        results could depend on its thread count (the exact arithmetic's torch products may split a sum among
        threads), so its steps always run on its home share. clock: CLOCK_MONOTONIC, one clock for every process
        of the host (tests give their own)."""
        self.spec, self.share, self.clock = spec, share, clock
        self.home = min(spec.homes[spec.slot], spec.cores)
        self._fd = os.open(spec.path, os.O_RDWR | os.O_CLOEXEC)
        self._busy = False
        if not share:
            self._update(True, borrow=False)

    def close(self) -> None:
        if self._fd >= 0:
            if self.share:
                self.idle()
            os.close(self._fd)
            self._fd = -1

    def _update(self, busy: bool, borrow: bool = True) -> int:
        """Under the lock: mark this worker busy or idle, give back what it borrowed, and (busy) borrow the home
        shares of siblings idle for LEND_AFTER_S while the host has cores that no busy worker uses; the threads it
        may use now."""
        n, me, homes = len(self.spec.homes), self.spec.slot, self.spec.homes
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            now = self.clock()
            rec = [list(r) for r in RECORD.iter_unpack(os.pread(self._fd, REC * n, 0))]  # [busy, lent, used, since]
            for j in range(n):
                if j != me and rec[j][1] == me + 1:
                    rec[j][1] = NOBODY  # what it borrowed for its last step goes back first
            rec[me][1] = NOBODY  # busy: its own cores are its own again at once; idle: free to lend
            threads = self.home if busy else 0
            if busy and borrow:
                used = sum(rec[j][2] for j in range(n) if j != me and rec[j][0] == BUSY)
                room = max(self.home, self.spec.cores - used)  # never below its own share
                for j in range(n):
                    if threads >= room:
                        break
                    if j != me and rec[j][0] == IDLE and rec[j][1] == NOBODY and now - rec[j][3] >= LEND_AFTER_S:
                        rec[j][1] = me + 1  # a sibling with no work: its cores are this worker's for this step
                        threads = min(threads + homes[j], room)
            if not busy and rec[me][0] == BUSY:
                rec[me][3] = now  # idle from now on
            rec[me][0], rec[me][2] = (BUSY if busy else IDLE), threads
            os.pwrite(self._fd, b"".join(RECORD.pack(*r) for r in rec), 0)
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)
        self._busy = busy
        return threads

    def take(self) -> int:
        """Before a step: this worker has work; the threads it may step on (its home share plus idle siblings')."""
        return self._update(True) if self.share else self.home

    def idle(self) -> None:
        """This worker has no work: its cores may be lent, and what it borrowed goes back. Cheap when already idle."""
        if self._busy and self.share:
            self._update(False)

    def table(self) -> list[tuple[int, int, int]]:
        """(busy, lent to, threads in use) of every slot, read under the lock: what the tests read."""
        n = len(self.spec.homes)
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            t = os.pread(self._fd, REC * n, 0)
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)
        return [(busy, lent, used) for busy, lent, used, _ in RECORD.iter_unpack(t)]

"""Cores lent between the workers that `kvseal serve` starts on one host.

Each worker has a home share of the host's cores: its threads (the cores split evenly among the workers, or the
flags). A worker with work borrows the home cores of every sibling that has none, so a lone long prompt is prefilled
on every core and a lone stream decodes on every core, while under load (every worker busy) each keeps its own
share and no two workers spin on one core. A lender that gets work again takes its cores back at once; the borrower
gives them up at its next step, so for at most one step of the borrower the host runs more threads than cores.

The table is 2 bytes a worker, (busy, lent to), in a memfd that launch.Fleet made and handed to each worker
(`LendSpec.path`, its /proc/self/fd path, opened again by each so each holds its own file description). Every read and
write of the table happens under an exclusive POSIX record lock (one process at a time), so a core is never lent to
two workers, and a worker that dies releases the lock with its process. A dead worker's slot keeps what it last
said: its own cores stay unlent if it died busy, and cores it had borrowed go back to their owners when they next
have work (a lender always takes its cores back).
"""

from __future__ import annotations

import fcntl
import os

import msgspec

IDLE, BUSY = 0, 1
NOBODY = 0  # lent-to byte: 0 nobody, else the borrower's slot + 1


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
    os.ftruncate(fd, 2 * workers)
    return fd


class CoreLending:
    """This worker's side of the table: `take()` before each step (the threads it may use), `idle()` when it has
    no work. Only the worker's stepping thread calls them."""

    def __init__(self, spec: LendSpec, share: bool = True) -> None:
        """share=False: this worker neither lends nor borrows (its slot says busy for good): for an engine whose
        results could depend on its thread count (the exact arithmetic's torch products may split a sum among
        threads), so its steps always run on its home share."""
        self.spec, self.share = spec, share
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
        """Under the lock: mark this worker busy or idle, reclaim or return cores; the threads it may use now."""
        n, me = len(self.spec.homes), self.spec.slot
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            t = bytearray(os.pread(self._fd, 2 * n, 0))
            state, lent = t[0::2], t[1::2]
            state[me] = BUSY if busy else IDLE
            lent[me] = NOBODY  # busy: its own cores are its own again; idle: it lends from now on, to whoever asks
            threads = self.home
            for j in range(n):
                if j == me:
                    continue
                if not busy and lent[j] == me + 1:
                    lent[j] = NOBODY  # idle: it gives back what it borrowed
                elif busy and borrow and state[j] == IDLE and lent[j] in (NOBODY, me + 1):
                    lent[j] = me + 1  # a sibling with no work: its home cores are this worker's for this step
                    threads += self.spec.homes[j]
                elif lent[j] == me + 1:
                    lent[j] = NOBODY  # its owner is busy again (it reclaimed them): returned
            t[0::2], t[1::2] = state, lent
            os.pwrite(self._fd, bytes(t), 0)
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)
        self._busy = busy
        return min(threads, self.spec.cores)

    def take(self) -> int:
        """Before a step: this worker has work; the threads it may step on (its home share plus idle siblings')."""
        return self._update(True) if self.share else self.home

    def idle(self) -> None:
        """This worker has no work: its cores may be lent, and what it borrowed goes back. Cheap when already idle."""
        if self._busy and self.share:
            self._update(False)

    def table(self) -> list[tuple[int, int]]:
        """(busy, lent to) of every slot, under the lock: what tests and /info read."""
        n = len(self.spec.homes)
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            t = os.pread(self._fd, 2 * n, 0)
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)
        return [(t[2 * j], t[2 * j + 1]) for j in range(n)]

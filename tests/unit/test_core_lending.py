"""The host's core-lending table (kvseal/worker/cores.py): a worker with work borrows the home threads of siblings
with none, a lender with work again takes its own back at once, a core is lent to one worker at a time, a worker
that must not change its thread count neither lends nor borrows, and the lock keeps out another process."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from kvseal.worker.cores import BUSY, IDLE, LEND_AFTER_S, REC, CoreLending, LendSpec, new_table


class Clock:
    """The table's clock, moved by the test: each call moves it past LEND_AFTER_S unless frozen."""

    def __init__(self) -> None:
        self.now, self.step = 100.0, LEND_AFTER_S

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _table(tmp_path: Path, homes: tuple[int, ...], cores: int, share: tuple[bool, ...] | None = None,
           clock: Clock | None = None) -> list[CoreLending]:
    path = tmp_path / "cores"
    path.write_bytes(bytes(REC * len(homes)))
    clock = clock or Clock()  # one clock for the host, as CLOCK_MONOTONIC is
    return [CoreLending(LendSpec(path=str(path), slot=i, homes=homes, cores=cores),
                        share=True if share is None else share[i], clock=clock) for i in range(len(homes))]


def test_a_busy_worker_borrows_an_idle_siblings_cores_until_the_sibling_has_work(tmp_path: Path) -> None:
    prefill, decode = _table(tmp_path, (1, 1), 2)
    assert prefill.take() == 2  # decode has no work: its core is prefill's for this step
    assert prefill.table() == [(BUSY, 0, 2), (IDLE, 1, 0)]  # decode's core, lent to slot 0
    assert decode.take() == 1  # decode has work again: its own core at once, never prefill's (busy)
    assert prefill.table()[1] == (BUSY, 0, 1)  # taken back
    assert prefill.take() == 1  # prefill's next step gives it up
    decode.idle()
    assert prefill.take() == 2  # and borrows it again once decode has none
    prefill.idle()
    assert prefill.table() == [(IDLE, 0, 0), (IDLE, 0, 0)]  # idle gives back what it borrowed
    assert decode.take() == 2  # a lone stream decodes on prefill's core too


def test_a_core_is_lent_to_one_worker_at_a_time(tmp_path: Path) -> None:
    a, b, c = _table(tmp_path, (2, 1, 1), 4)
    assert a.take() == 4  # b's and c's cores
    assert b.take() == 1  # b reclaims its own; c's stays a's: not lent twice
    assert a.table()[2] == (IDLE, 1, 0)
    assert a.take() == 3
    assert c.take() == 1
    assert a.take() == 2  # back to its home share: nothing left to borrow
    b.idle()
    assert c.take() == 2  # b's core goes to whoever asks first once it is free
    assert a.take() == 2  # already lent to c
    assert [lent for _, lent, _ in a.table()] == [0, 3, 0]


def test_cores_are_lent_only_after_their_owner_had_no_work_for_a_while(tmp_path: Path) -> None:
    clock = Clock()
    prefill, decode = _table(tmp_path, (1, 1), 2, clock=clock)
    assert decode.take() == 2  # prefill never had work: lent from the start
    prefill.take()
    prefill.idle()
    clock.step = LEND_AFTER_S / 10
    assert decode.take() == 1  # prefill's gap so far is shorter than LEND_AFTER_S: a burst's gaps lend nothing
    assert decode.take() == 1
    clock.now += LEND_AFTER_S
    assert decode.take() == 2  # idle long enough: its core is lent


def test_no_step_runs_more_threads_than_the_host_has(tmp_path: Path) -> None:
    a, _ = _table(tmp_path, (2, 2), 3)  # --threads 2 for both on 3 cores
    assert a.take() == 3


def test_only_cores_no_busy_worker_uses_are_lent(tmp_path: Path) -> None:
    p1, _, d1, _ = _table(tmp_path, (1, 1, 1, 1), 2)  # --prefill 2 --decode 2 on 2 cores: homes add up to 4
    assert p1.take() == 2  # one idle sibling's core: the host's two
    assert d1.take() == 1  # its own share, whatever is in use (the homes oversubscribe, as configured)
    assert p1.take() == 1  # no core is free: it borrows none, though p2 and d2 are idle
    assert sum(used for busy, _, used in p1.table() if busy) == 2
    d1.idle()
    assert p1.take() == 2
    assert [lent for _, lent, _ in p1.table()].count(1) == 1  # one sibling's core, not every idle one's


def test_a_worker_that_must_keep_its_thread_count_neither_lends_nor_borrows(tmp_path: Path) -> None:
    exact, fast = _table(tmp_path, (1, 1), 2, share=(False, True))
    assert fast.table()[0] == (BUSY, 0, 1)  # busy for good from its start
    assert fast.take() == 1  # so its core is never lent, even with no work
    assert exact.take() == 1  # and it never borrows
    fast.idle()
    assert exact.take() == 1
    exact.idle()
    assert fast.take() == 1


def test_a_closed_worker_gives_back_what_it_borrowed(tmp_path: Path) -> None:
    prefill, decode = _table(tmp_path, (1, 1), 2)
    assert decode.take() == 2
    decode.close()
    assert prefill.table() == [(IDLE, 0, 0), (IDLE, 0, 0)]
    assert prefill.take() == 2


def _hold_lock(path: str, held: Any, release: Any) -> None:  # multiprocessing Events
    fd = os.open(path, os.O_RDWR)
    fcntl.lockf(fd, fcntl.LOCK_EX)
    held.set()
    release.wait(30)
    fcntl.lockf(fd, fcntl.LOCK_UN)
    os.close(fd)


def test_the_table_is_locked_against_another_process(tmp_path: Path) -> None:
    prefill, _ = _table(tmp_path, (1, 1), 2)
    ctx = mp.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold_lock, args=(prefill.spec.path, held, release))
    other.start()
    try:
        assert held.wait(30)
        got: list[int] = []
        t = threading.Thread(target=lambda: got.append(prefill.take()))
        t.start()
        t.join(0.5)
        assert t.is_alive() and not got  # waiting for the other process's lock, not reading a half-written table
        release.set()
        t.join(30)
        assert got == [2]
    finally:
        release.set()
        other.join(30)


def test_the_launchers_table_is_a_memfd_each_worker_opens_as_its_own(tmp_path: Path) -> None:
    fd = new_table(2)
    try:
        assert os.fstat(fd).st_size == 2 * REC and os.get_inheritable(fd)  # Popen(pass_fds=) hands it down
        path = f"/proc/self/fd/{fd}"
        a = CoreLending(LendSpec(path=path, slot=0, homes=(1, 1), cores=2))
        b = CoreLending(LendSpec(path=path, slot=1, homes=(1, 1), cores=2))
        assert a.take() == 2 and b.take() == 1 and a.take() == 1
        a.close()
        b.close()
    finally:
        os.close(fd)


@pytest.mark.parametrize("bad", [{"homes": ()}, {"homes": (1, 0)}, {"slot": 2}, {"cores": 0}])
def test_a_malformed_lend_spec_is_refused(bad: dict[str, object]) -> None:
    fields: dict[str, object] = {"path": "/dev/null", "slot": 0, "homes": (1, 1), "cores": 2, **bad}
    with pytest.raises(ValueError, match="invalid lending"):
        LendSpec(**fields)  # type: ignore[arg-type]

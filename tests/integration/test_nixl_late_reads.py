"""A NIXL read is over before its pages are (issue 17, section 2), with real bytes landing late.

UCX cancels only tag receives: an RMA GET keeps running after its handle is released, so a decode worker that
scrubbed and freed its pages at the read's deadline had them overwritten later, possibly after they were given
to the next request. Here the GET outlives its deadline for real: over UCX's TCP transport the prefill process
serves a GET itself, so stopping it (SIGSTOP) right after decode claimed its pages holds the read; continuing it
(SIGCONT) half a second later lets every byte land. The request must end at its deadline (the client is not held
hostage), its pages must stay owned and out of the pool until NIXL says the read is over, and from then on
nothing may change in them.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvseal.engine.messages import GenerateDelta
from kvseal.errors import KvsealError
from kvseal.lifecycle import State
from kvseal.transfer.manifest import KVManifest
from tests.helpers.kv_peers import PoolSpec, PrefillProcess, decode_worker, pump, reserve

pytestmark = pytest.mark.integration


@pytest.fixture
def tcp_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("UCX_TLS", "tcp")  # read by each NIXL agent made from here on, here and in children
    yield


def test_a_read_past_its_deadline_keeps_its_pages_until_nixl_says_it_is_over(tcp_only: None) -> None:
    with decode_worker("nixl", pool_tokens=128) as w:
        d = w.dengine
        prefill = PrefillProcess(PoolSpec.of(d))
        stopped: list[float] = []
        try:
            warm = reserve(w, "warm")  # wires the UCX connection: the late read below is a read like any other
            prefill.send(warm, [1, 2, 3])
            pump(w, lambda: "warm" not in d.seqs)
            assert d.allocator.num_free == d.pool.num_pages

            res = reserve(w, "late")
            pages, owner = res.page_ids, d.seqs["late"].owner
            real_claim = w._claim

            def claim(m: KVManifest) -> list[int]:
                got = real_claim(m)
                os.kill(prefill.pid, signal.SIGSTOP)  # decode posts its READ right after this; nobody serves it
                wait_stopped(prefill.pid)
                stopped.append(time.monotonic())
                return got

            w._claim = claim  # type: ignore[method-assign]
            prefill.send(res, [4, 5, 6], timeout_s=0.2)  # decode waits for the read half of it: 0.1 s
            finals: dict[str, GenerateDelta] = {}
            owned: list[bool] = []  # from the claim until the landing ended: still the request's own pages?
            next_pages: list[int] = []
            continued: list[float] = []

            def landing_over() -> bool:
                if not stopped:
                    return False
                now = time.monotonic()
                if not continued and now > stopped[0] + 0.5:
                    os.kill(prefill.pid, signal.SIGCONT)  # the stalled GET goes on: its bytes land now
                    continued.append(now)
                over = ("late" not in d.landing and "late" not in d.quarantined
                        and w.info().get("kv_reads_in_flight", 0) == 0)
                if not over:
                    owned.append(d.allocator.owns(owner, pages))
                if "late" in finals and not next_pages:  # the request ended: the next one takes all it can
                    want = min(d.pages_available(), 28) * d.pool.page_size
                    next_pages.extend(reserve(w, "next", prompt=want).page_ids)
                return over

            pump(w, landing_over, finals=finals)
            snapshot = (d.pool.k[:, pages].clone(), d.pool.v[:, pages].clone())
            ended_at = time.monotonic()
            pump(w, lambda: time.monotonic() > max(ended_at, stopped[0] + 0.5) + 1.0)  # bytes may land meanwhile
        finally:
            if stopped:
                os.kill(prefill.pid, signal.SIGCONT)
            figures = prefill.figures() if prefill.proc.is_alive() else {}
            prefill.close()

        changed = (~torch.eq(d.pool.k[:, pages], snapshot[0])).sum() + (~torch.eq(d.pool.v[:, pages], snapshot[1])).sum()
        assert int(changed) == 0, f"{int(changed)} elements of the freed pages changed after the read was over"
        assert not snapshot[0].any() and not snapshot[1].any(), "the pages were not scrubbed when they were freed"
        assert continued and ended_at > continued[0], "the pages were freed while the prefill worker was stopped"
        assert all(owned) and owned, "the pages left the request's ownership while its read could still land"
        assert next_pages and not set(next_pages) & set(pages), f"pages {set(next_pages) & set(pages)} reused"
        late = finals["late"]  # ended at its deadline, long before the bytes could land: a 504, not a hostage
        assert late.error is not None and late.error.code == "transfer_timeout" and late.error.status == 504
        assert "next" in d.seqs and d.seqs["next"].life.state is State.RESERVED
        d.release("next", KvsealError.from_info(late.error), rejected=False)
        d.allocator.check_integrity()
        assert d.allocator.num_free == d.pool.num_pages and not d.landing and not d.quarantined
        assert figures.get("kv_export_pages_held") == 0  # prefill's window pages were freed at decode's answer


def wait_stopped(pid: int) -> None:
    """SIGSTOP takes effect asynchronously: wait until every thread of the process is stopped."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = [Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0]
                  for t in os.listdir(f"/proc/{pid}/task")]
        if all(s == "T" for s in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop")

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

import msgspec
import pytest
import torch
import zmq

from kvseal.engine.decode_admission import pages_available
from kvseal.errors import KvsealError, TransferTimeout
from kvseal.lifecycle import State
from kvseal.transfer.base import TransferHandle, TransferState, create_transport
from kvseal.transfer.manifest import KVManifest, PoolPages
from kvseal.transfer.zmq_wire import TransferHeader, TransferReply
from kvseal.wire.kvspec import KVSpec
from kvseal.wire.messages import GenerateDelta
from kvseal.wire.reservation import Reservation, new_nonce, new_reservation_id
from tests.helpers.kv_peers import PoolSpec, PrefillProcess, decode_worker, pump, reserve, wait_status

pytestmark = pytest.mark.integration


@pytest.fixture
def tcp_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("UCX_TLS", "tcp")  # read by each NIXL agent made from here on, here and in children
    yield


def test_a_read_past_its_deadline_keeps_its_pages_until_nixl_says_it_is_over(tcp_only: None) -> None:
    with decode_worker("nixl", pool_tokens=128) as w:
        d = w.engine
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
                over = ("late" not in d.kv.landing and "late" not in d.kv.quarantined
                        and w.info().get("kv_reads_in_flight", 0) == 0)
                if not over:
                    owned.append(d.allocator.owns(owner, pages))
                if "late" in finals and not next_pages:  # the request ended: the next one takes all it can
                    want = min(pages_available(d), 28) * d.pool.page_size
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

        changed = ((~torch.eq(d.pool.k[:, pages], snapshot[0])).sum()
                   + (~torch.eq(d.pool.v[:, pages], snapshot[1])).sum())
        assert int(changed) == 0, f"{int(changed)} elements of the freed pages changed after the read was over"
        assert not snapshot[0].any() and not snapshot[1].any(), "the pages were not scrubbed when they were freed"
        assert continued and ended_at > continued[0], "the pages were freed while the prefill worker was stopped"
        assert all(owned) and owned, "the pages left the request's ownership while its read could still land"
        assert next_pages and not set(next_pages) & set(pages), f"pages {set(next_pages) & set(pages)} reused"
        late = finals["late"]  # ended at its deadline, long before the bytes could land: a 504, not a hostage
        assert late.error is not None and late.error.code == "transfer_timeout" and late.error.status == 504
        assert "next" in d.seqs and d.seqs["next"].life.state is State.RESERVED
        d.kv.release("next", KvsealError.from_info(late.error), rejected=False)
        d.allocator.check_integrity()
        assert d.allocator.num_free == d.pool.num_pages and not d.kv.landing and not d.kv.quarantined
        assert figures.get("kv_export_pages_held") == 0  # prefill's window pages were freed at decode's answer


def test_a_read_whose_prefill_worker_died_is_over_and_its_pages_come_back(tcp_only: None) -> None:
    """The prefill worker is killed while decode's READ is held: no byte can come from a dead process, NIXL says
    so (the remote is disconnected), and that ends the read like ERR does. The pages are scrubbed and freed, the
    request fails with worker_failed, and the next reservation can have them: never quarantined for ever."""
    with decode_worker("nixl", pool_tokens=128) as w:
        d = w.engine
        prefill = PrefillProcess(PoolSpec.of(d))
        stopped: list[float] = []
        try:
            warm = reserve(w, "warm")
            prefill.send(warm, [1, 2, 3])
            pump(w, lambda: "warm" not in d.seqs)
            res = reserve(w, "doomed")
            pages = res.page_ids
            real_claim = w._claim

            def claim(m: KVManifest) -> list[int]:
                got = real_claim(m)
                os.kill(prefill.pid, signal.SIGSTOP)  # the READ is posted to a stopped peer ...
                wait_stopped(prefill.pid)
                stopped.append(time.monotonic())
                return got

            w._claim = claim  # type: ignore[method-assign]
            prefill.send(res, [4, 5, 6], timeout_s=30.0)
            finals: dict[str, GenerateDelta] = {}
            killed: list[float] = []

            def read_over() -> bool:
                if stopped and not killed and time.monotonic() > stopped[0] + 0.3:
                    os.kill(prefill.pid, signal.SIGKILL)  # ... which then dies with it in flight
                    killed.append(time.monotonic())
                return ("doomed" in finals and "doomed" not in d.kv.landing and "doomed" not in d.kv.quarantined
                        and w.info().get("kv_reads_in_flight", 0) == 0)

            pump(w, read_over, timeout=60.0, finals=finals)
        finally:
            if prefill.proc.is_alive():
                os.kill(prefill.pid, signal.SIGKILL)
            prefill.proc.join(10)
        err = finals["doomed"].error
        assert err is not None and err.code == "worker_failed" and err.status == 502, err
        assert killed, "the read ended before the prefill worker was killed: nothing was tested"
        assert not d.pool.k[:, pages].any() and not d.pool.v[:, pages].any(), "freed pages were not scrubbed"
        d.allocator.check_integrity()
        assert d.allocator.num_free == d.pool.num_pages and not d.kv.landing and not d.kv.quarantined
        assert set(reserve(w, "next", prompt=len(pages) * d.pool.page_size).page_ids) <= set(range(d.pool.num_pages))


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


def test_prefill_keeps_what_it_offered_until_decode_answers_even_after_its_own_timeout() -> None:
    """Prefill's side of the same rule: pages it offered stay in its export window (readable, unchanged) until the
    decode worker answers, which it does only once its read is over, however late; prefill's own transfer timeout
    fails the handoff but frees nothing a read may still be copying. An offer that finds the window full waits."""
    spec = PoolSpec(shape=(2, 16, 4, 2, 8), dtype="bfloat16", fingerprint="fp", page_size=4, kv_layout="L2")
    k, v = spec.pool(2)
    ctx = zmq.Context()
    decode = ctx.socket(zmq.ROUTER)  # a decode worker that reads the offer and answers only much later
    decode.setsockopt(zmq.LINGER, 0)
    endpoint = (decode.bind("tcp://127.0.0.1:0"), decode.getsockopt_string(zmq.LAST_ENDPOINT))[1]
    try:
        with create_transport("nixl", timeout_s=30.0, export_pages=4) as tx:
            tx.register(k, v)

            def send(rid: str, pages: tuple[int, ...]) -> TransferHandle:
                res = Reservation(request_id=rid, reservation_id=new_reservation_id(), nonce=new_nonce(),
                                  num_tokens=4 * len(pages), page_ids=list(pages), kv=KVSpec(model_fingerprint="fp",
                                  page_size=4, kv_dtype="bfloat16", kv_layout="L2"), kv_endpoint=endpoint)
                src = PoolPages(k, v, pages)
                return tx.send(endpoint, spec.manifest(res, src), src, timeout_s=0.3)

            first = send("first", (0, 1, 2))
            ident, header, _ = decode.recv_multipart()
            second = send("second", (5, 6))  # 2 pages, 1 free: waits, nothing offered yet
            assert tx.figures() == {"kv_export_pages_held": 3, "kv_export_pages_overdue": 0, "kv_offers_waiting": 1}
            assert not decode.poll(100)
            assert wait_status(tx, first).state is TransferState.TIMED_OUT  # the handoff fails ...
            late = wait_status(tx, second)
            assert late.state is TransferState.TIMED_OUT and late.error is not None
            assert "waited 0.3s for room in the NIXL export window" in late.error.message
            tx.tend()
            assert tx.figures() == {"kv_export_pages_held": 3, "kv_export_pages_overdue": 3,
                                    "kv_offers_waiting": 0}  # ... but what decode may be reading stays
            tid = msgspec.msgpack.decode(header, type=TransferHeader).transfer_id
            decode.send_multipart([ident, msgspec.msgpack.encode(TransferReply(
                transfer_id=tid, ok=False, error=TransferTimeout("read over, late").to_info()))])
            deadline = time.monotonic() + 10
            while tx.figures()["kv_export_pages_held"] and time.monotonic() < deadline:
                tx.tend()  # the prefill worker's loop takes late answers
                time.sleep(0.005)
            assert tx.figures()["kv_export_pages_held"] == 0
            third = send("third", (8, 9, 10, 11))  # the whole window is free again: offered at once
            assert decode.poll(5000)
            decode.recv_multipart()
            tx.abort(third)
            empty = send("empty", ())  # no page at all (a peer's fault): offered, nothing held
            assert decode.poll(5000)
            tx.abort(empty)
    finally:
        decode.close(0)
        ctx.term()

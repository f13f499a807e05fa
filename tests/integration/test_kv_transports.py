"""Both KV transports (ZeroMQ, NIXL over UCX) over real sockets on 127.0.0.1, held to the same seals: a transfer
lands in exactly the reserved pages and is acked only after its checksums match (seal 4); a corrupted page, a
wrong nonce or a wrong reservation is nacked with the original error and leaves the reserved pages as they were
(zero: an in-place transport moves no byte for a manifest that does not name the reservation, and the pages of a
corrupted one are scrubbed); a stalled or dead peer ends in a timeout or failure, never an ack.

The receiver runs the decode worker's transfer loop in a thread (claim, verify, unpack or verify in place, reply);
the sender is this thread, or a separate process that dies mid-handoff.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import pytest
import torch

from kvseal.errors import KvsealError, TransferTimeout, TransferVerificationFailed, WorkerFailed
from kvseal.transfer.base import (
    Arrival,
    TransferHandle,
    TransferState,
    TransferStatus,
    Transport,
    create_transport,
)
from kvseal.transfer.manifest import (
    KVManifest,
    PagePayload,
    PoolPages,
    build_manifest,
    dtype_name,
    page_nbytes,
    unpack_into,
)
from kvseal.transfer.verify import verify, verify_identity
from kvseal.wire.kvspec import KVSpec
from kvseal.wire.reservation import Reservation, new_nonce, new_reservation_id
from tests.helpers.transports import KV_TRANSPORTS

pytestmark = [pytest.mark.integration, pytest.mark.serial]  # serial: measures time (scripts/test.sh)

L, P, S, KVH, D = 3, 16, 4, 2, 8
FP = "fp-test"
LAYOUT = f"L{L}xPxSx{KVH}x{D}"
DTYPE = torch.bfloat16


def new_pool(seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if seed is None:
        return torch.zeros(L, P, S, KVH, D, dtype=DTYPE), torch.zeros(L, P, S, KVH, D, dtype=DTYPE)
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, P, S, KVH, D, generator=g).to(DTYPE), torch.randn(L, P, S, KVH, D, generator=g).to(DTYPE))


@dataclass
class Decode:
    """A decode worker's transfer loop in a thread: claim (in place), verify, land, answer."""

    kind: str
    endpoint: str = ""
    k: torch.Tensor = field(default_factory=lambda: new_pool()[0])
    v: torch.Tensor = field(default_factory=lambda: new_pool()[1])
    reservations: dict[str, Reservation] = field(default_factory=dict)
    outcomes: queue.Queue[tuple[str, bool, str]] = field(default_factory=queue.Queue)
    stop: threading.Event = field(default_factory=threading.Event)
    claimed: list[str] = field(default_factory=list)

    def reserve(self, request_id: str, num_tokens: int, page_ids: list[int]) -> Reservation:
        res = Reservation(request_id=request_id, reservation_id=new_reservation_id(), nonce=new_nonce(),
                          num_tokens=num_tokens, page_ids=page_ids, kv=KVSpec(model_fingerprint=FP, page_size=S,
                          kv_dtype=dtype_name(DTYPE), kv_layout=LAYOUT), kv_endpoint=self.endpoint)
        self.reservations[request_id] = res
        return res

    def claim(self, m: KVManifest) -> list[int]:
        res = self.reservations.pop(m.request_id, None)
        if res is None:
            raise TransferVerificationFailed(f"KV arrived for request {m.request_id!r}, which holds no reservation")
        verify_identity(m, res, expected_fingerprint=FP)
        self.claimed.append(m.request_id)
        self.reservations[m.request_id] = res
        return res.page_ids

    def handle(self, a: Arrival) -> None:
        rid = a.manifest.request_id
        res = self.reservations.pop(rid, None)
        try:
            if a.error is not None:
                raise KvsealError.from_info(a.error)
            if res is None:
                raise TransferVerificationFailed(f"KV arrived for request {rid!r}, which holds no reservation")
            pages = a.landed if a.landed is not None else a.payload
            assert pages is not None
            verify(a.manifest, res, pages, expected_fingerprint=FP, page_bytes=page_nbytes(self.k))
            if a.payload is not None:
                unpack_into(self.k, self.v, res.page_ids, a.payload)
        except KvsealError as err:
            if res is not None:  # the request fails: its reserved pages are scrubbed
                self.k[:, res.page_ids] = 0
                self.v[:, res.page_ids] = 0
            if not a.answered:
                a.reply(False, err.to_info())
            self.outcomes.put((rid, False, err.code))
            return
        a.reply(True)
        self.outcomes.put((rid, True, ""))

    def run(self, ready: threading.Event) -> None:
        with create_transport(self.kind, timeout_s=5.0) as rx:
            rx.register(self.k, self.v)
            self.endpoint = rx.listen("tcp://127.0.0.1:0")
            ready.set()
            while not self.stop.is_set():
                arrival = rx.recv(0.02, self.claim)
                if arrival is not None:
                    self.handle(arrival)


@pytest.fixture(params=KV_TRANSPORTS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def decode(kind: str) -> Iterator[Decode]:
    d = Decode(kind)
    ready = threading.Event()
    t = threading.Thread(target=d.run, args=(ready,), daemon=True)
    t.start()
    assert ready.wait(30), "the receiver did not start"
    yield d
    d.stop.set()
    t.join(10)


@dataclass
class Prefill:
    tx: Transport
    k: torch.Tensor
    v: torch.Tensor

    def offer(self, res: Reservation, pages: list[int]) -> tuple[KVManifest, PagePayload | PoolPages]:
        src = PoolPages(self.k, self.v, tuple(pages))
        payload: PagePayload | PoolPages = src.pack() if self.tx.staged else src
        man = build_manifest(res, src, num_tokens=res.num_tokens, first_token=7, kv=KVSpec(model_fingerprint=FP,
                             page_size=S, kv_dtype=dtype_name(DTYPE), kv_layout=LAYOUT))
        return man, payload


@pytest.fixture
def prefill(kind: str) -> Iterator[Prefill]:
    k, v = new_pool(seed=1)
    with create_transport(kind, timeout_s=10.0) as tx:
        tx.register(k, v)
        yield Prefill(tx, k, v)


def wait_done(tx: Transport, h: TransferHandle, timeout: float = 30.0) -> TransferStatus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = tx.poll(h)
        if st.done:
            return st
        time.sleep(0.005)
    raise AssertionError("no terminal status")


SRC, DST = [5, 2, 9], [11, 0, 4]


def test_transfer_lands_in_exactly_the_reserved_pages_and_is_acked(decode: Decode, prefill: Prefill) -> None:
    res = decode.reserve("r1", num_tokens=3 * S - 1, page_ids=DST)
    man, payload = prefill.offer(res, SRC)
    h = prefill.tx.send(decode.endpoint, man, payload)
    st = wait_done(prefill.tx, h)
    assert st == TransferStatus(TransferState.ACKED), st
    with pytest.raises(KeyError):  # a terminal status is reported once
        prefill.tx.poll(h)
    assert decode.outcomes.get(timeout=5) == ("r1", True, "")
    assert torch.equal(decode.k[:, DST], prefill.k[:, SRC]) and torch.equal(decode.v[:, DST], prefill.v[:, SRC])
    others = [p for p in range(P) if p not in DST]
    assert not decode.k[:, others].any() and not decode.v[:, others].any()  # no byte outside the reservation
    assert decode.claimed == (["r1"] if decode.kind == "nixl" else [])


def test_a_corrupted_page_is_nacked_and_its_pages_scrubbed(decode: Decode, prefill: Prefill) -> None:
    res = decode.reserve("r2", num_tokens=3 * S, page_ids=DST)
    man, payload = prefill.offer(res, SRC)
    if isinstance(payload, PoolPages):  # in place: the source page changes after its checksum was taken
        prefill.k[1, SRC[1], 0, 0, 0] += 1
    else:
        k = payload.k.clone()
        k[k.numel() // 2] ^= 0x01
        payload = PagePayload(k, payload.v, payload.num_pages)
    st = wait_done(prefill.tx, prefill.tx.send(decode.endpoint, man, payload))
    assert st.state is TransferState.REJECTED and st.error is not None
    assert st.error.code == "kv_verification_failed"
    assert f"page_checksums[1] (reserved page {DST[1]};" in st.error.message
    with pytest.raises(TransferVerificationFailed):
        st.raise_for_error()
    assert decode.outcomes.get(timeout=5) == ("r2", False, "kv_verification_failed")
    assert not decode.k.any() and not decode.v.any()


@pytest.mark.parametrize("tamper", ["wrong_nonce", "wrong_reservation", "unknown_request"])
def test_a_manifest_that_does_not_name_the_reservation_moves_nothing(decode: Decode, prefill: Prefill,
                                                                     tamper: str) -> None:
    res = decode.reserve("r3", num_tokens=3 * S, page_ids=DST)
    man, payload = prefill.offer(res, SRC)
    man = msgspec.structs.replace(man, **{
        "wrong_nonce": {"nonce": new_nonce()}, "wrong_reservation": {"reservation_id": new_reservation_id()},
        "unknown_request": {"request_id": "someone-else"}}[tamper])
    st = wait_done(prefill.tx, prefill.tx.send(decode.endpoint, man, payload))
    assert st.state is TransferState.REJECTED and st.error is not None
    assert st.error.code == "kv_verification_failed"
    want = {"wrong_nonce": "nonce", "wrong_reservation": "reservation_id", "unknown_request": "no reservation"}
    assert want[tamper] in st.error.message
    assert not decode.k.any() and not decode.v.any()  # not one byte in any page
    assert decode.claimed == []


def test_a_stalled_receiver_times_out_the_sender(kind: str, prefill: Prefill) -> None:
    k, v = new_pool()
    with create_transport(kind, timeout_s=5.0) as rx:  # listens, registers, never reads
        rx.register(k, v)
        endpoint = rx.listen("tcp://127.0.0.1:0")
        res = Reservation(request_id="r4", reservation_id=new_reservation_id(), nonce=new_nonce(), num_tokens=S,
                          page_ids=[0], kv=KVSpec(model_fingerprint=FP, page_size=S, kv_dtype=dtype_name(DTYPE),
                          kv_layout=LAYOUT), kv_endpoint=endpoint)
        man, payload = prefill.offer(res, [3])
        t0 = time.monotonic()
        h = prefill.tx.send(endpoint, man, payload, timeout_s=0.5)
        assert prefill.tx.poll(h).state is TransferState.PENDING
        st = wait_done(prefill.tx, h)
        elapsed = time.monotonic() - t0
        assert st.state is TransferState.TIMED_OUT and st.error is not None and 0.5 <= elapsed < 2.0
        err = KvsealError.from_info(st.error)
        assert isinstance(err, TransferTimeout) and err.status == 504 and "r4" in err.message
    assert not k.any()


def _dying_sender(kind: str, endpoint: str, res_bytes: bytes, sent: mp.Queue[str]) -> None:
    import os
    import signal

    k, v = new_pool(seed=2)
    tx = create_transport(kind, timeout_s=30.0)
    tx.register(k, v)
    res = msgspec.msgpack.decode(res_bytes, type=Reservation)
    src = PoolPages(k, v, (1, 2))
    man = build_manifest(res, src, num_tokens=res.num_tokens, first_token=7,
                         kv=KVSpec(model_fingerprint=FP, page_size=S, kv_dtype=dtype_name(DTYPE), kv_layout=LAYOUT))
    h = tx.send(endpoint, man, src.pack() if tx.staged else src)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not tx.poll(h).done and tx.staged:
        time.sleep(0.01)  # zmq: let the bytes leave before dying
    time.sleep(0.2)
    sent.put("sent")
    sent.close()
    sent.join_thread()  # the message is out before the process dies
    os.kill(os.getpid(), signal.SIGKILL)  # the prefill worker dies mid-handoff


def test_a_sender_that_dies_mid_handoff_never_gets_pages_admitted_that_did_not_arrive(kind: str) -> None:
    """NIXL: decode reads from a dead peer; the read fails or times out, the pages end scrubbed, nothing acked.
    ZeroMQ: the bytes were already in flight as a whole message; they arrive complete and verify, or not at all."""
    k, v = new_pool()
    outcomes: list[tuple[str, str]] = []
    with create_transport(kind, timeout_s=2.0) as rx:
        rx.register(k, v)
        endpoint = rx.listen("tcp://127.0.0.1:0")
        res = Reservation(request_id="r5", reservation_id=new_reservation_id(), nonce=new_nonce(),
                          num_tokens=2 * S, page_ids=[6, 7], kv=KVSpec(model_fingerprint=FP, page_size=S,
                          kv_dtype=dtype_name(DTYPE), kv_layout=LAYOUT), kv_endpoint=endpoint)
        ctx = mp.get_context("spawn")
        sent: mp.Queue[str] = ctx.Queue()
        proc = ctx.Process(target=_dying_sender, args=(kind, endpoint, msgspec.msgpack.encode(res), sent))
        if kind == "nixl":  # the offer is read only once the sender is dead
            proc.start()
            assert sent.get(timeout=60) == "sent"
            proc.join(30)
        else:
            proc.start()
        claimed: list[int] = []

        def claim(m: KVManifest) -> list[int]:
            verify_identity(m, res, expected_fingerprint=FP)
            claimed.extend(res.page_ids)
            return res.page_ids

        deadline = time.monotonic() + 30
        while not outcomes and time.monotonic() < deadline:
            a = rx.recv(0.1, claim)
            if a is None:
                continue
            if a.error is not None:
                outcomes.append(("failed", a.error.code))
            elif a.landed is not None:
                verify(a.manifest, res, a.landed, expected_fingerprint=FP, page_bytes=page_nbytes(k))
                outcomes.append(("landed", ""))
            else:
                assert a.payload is not None
                verify(a.manifest, res, a.payload, expected_fingerprint=FP, page_bytes=page_nbytes(k))
                outcomes.append(("staged", ""))
        proc.join(30)
    if kind == "nixl":
        assert claimed == [6, 7]
        assert outcomes and outcomes[0][0] == "failed" and outcomes[0][1] in (WorkerFailed.code, TransferTimeout.code)
    else:
        assert outcomes == [("staged", "")]


def test_the_registry_names_both_transports() -> None:
    from kvseal.transfer.base import transport_class
    from kvseal.transfer.zmq import ZmqTransport

    assert transport_class("zmq") is ZmqTransport and ZmqTransport.staged
    from kvseal.transfer.nixl import NixlTransport

    assert transport_class("nixl") is NixlTransport and not NixlTransport.staged
    with pytest.raises(ValueError, match="use one of nixl, zmq"):
        transport_class("tcp")


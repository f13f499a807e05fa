"""What only the ZeroMQ KV transport does, over real sockets on 127.0.0.1 (a decode-side receiver thread, a
prefill-side sender). The seals both transports keep are tested for both in test_kv_transports.py."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import pytest
import torch
import zmq

from kvseal.errors import TransferVerificationFailed
from kvseal.transfer.base import TransferHandle, TransferState, TransferStatus
from kvseal.transfer.manifest import (
    KVManifest,
    PagePayload,
    build_manifest,
    dtype_name,
    pack_pages,
    page_nbytes,
    unpack_into,
)
from kvseal.transfer.verify import verify
from kvseal.transfer.zmq import ZmqTransport
from kvseal.transfer.zmq_wire import TransferReply
from kvseal.wire.kvspec import KVSpec
from kvseal.wire.reservation import Reservation, new_nonce, new_reservation_id

pytestmark = pytest.mark.integration

L, P, S, KVH, D = 2, 16, 4, 2, 8
FP = "fp-test"
LAYOUT = f"L{L}xPxSx{KVH}x{D}"
DTYPE = torch.bfloat16


def new_pool() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(L, P, S, KVH, D, dtype=DTYPE), torch.zeros(L, P, S, KVH, D, dtype=DTYPE)


@dataclass
class Decode:
    """A decode worker's transfer loop in a thread: verify against the reservation, unpack, answer."""

    endpoint: str = ""
    k: torch.Tensor = field(default_factory=lambda: new_pool()[0])
    v: torch.Tensor = field(default_factory=lambda: new_pool()[1])
    reservations: dict[str, Reservation] = field(default_factory=dict)
    outcomes: queue.Queue[tuple[str, bool]] = field(default_factory=queue.Queue)
    stop: threading.Event = field(default_factory=threading.Event)

    def reserve(self, request_id: str, num_tokens: int, page_ids: list[int]) -> Reservation:
        res = Reservation(request_id=request_id, reservation_id=new_reservation_id(), nonce=new_nonce(),
                          num_tokens=num_tokens, page_ids=page_ids, kv=KVSpec(model_fingerprint=FP, page_size=S,
                          kv_dtype=dtype_name(DTYPE), kv_layout=LAYOUT), kv_endpoint=self.endpoint)
        self.reservations[request_id] = res
        return res

    def run(self, ready: queue.Queue[str]) -> None:
        with ZmqTransport() as rx:
            ready.put(rx.listen("tcp://127.0.0.1:0"))
            while not self.stop.is_set():
                arrival = rx.recv(0.02)
                if arrival is None:
                    continue
                res = self.reservations[arrival.manifest.request_id]
                try:
                    verify(arrival.manifest, res, arrival.payload, expected_fingerprint=FP,
                           page_bytes=page_nbytes(self.k))
                except TransferVerificationFailed as e:
                    arrival.reply(False, e.to_info())
                    self.outcomes.put((res.request_id, False))
                    continue
                unpack_into(self.k, self.v, res.page_ids, arrival.payload)
                arrival.reply(True)
                self.outcomes.put((res.request_id, True))


@pytest.fixture
def decode() -> Iterator[Decode]:
    d, ready = Decode(), queue.Queue[str]()
    t = threading.Thread(target=d.run, args=(ready,), daemon=True)
    t.start()
    d.endpoint = ready.get(timeout=5)
    yield d
    d.stop.set()
    t.join(timeout=5)
    assert not t.is_alive()


def prefill_kv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (L, P, S, KVH, D)
    return torch.randn(shape, generator=g).to(DTYPE), torch.randn(shape, generator=g).to(DTYPE)


def handoff(res: Reservation, pages: list[int], seed: int = 0) -> tuple[KVManifest, PagePayload]:
    k, v = prefill_kv(seed)
    payload = pack_pages(k, v, pages)
    man = build_manifest(res, payload, num_tokens=res.num_tokens, first_token=3, kv=KVSpec(model_fingerprint=FP,
                         page_size=S, kv_dtype=dtype_name(DTYPE), kv_layout=LAYOUT))
    return man, payload


def wait_done(tx: ZmqTransport, handle: TransferHandle, within_s: float = 5.0) -> TransferStatus:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        status = tx.poll(handle)
        if status.done:
            return status
        time.sleep(0.002)
    raise AssertionError(f"transfer {handle} still pending after {within_s}s")


def test_unreachable_endpoint_times_out() -> None:
    with ZmqTransport() as probe:  # find a free port, then stop listening on it
        endpoint = probe.listen("tcp://127.0.0.1:0")
    with ZmqTransport(timeout_s=0.2) as tx:
        res = Reservation(request_id="req-gone", reservation_id="r", nonce=new_nonce(), num_tokens=4,
                          page_ids=[0], kv=KVSpec(model_fingerprint=FP, page_size=S, kv_dtype="bfloat16",
                          kv_layout=LAYOUT), kv_endpoint=endpoint)
        status = wait_done(tx, tx.send(endpoint, *handoff(res, pages=[0])), within_s=2.0)
    assert status.state is TransferState.TIMED_OUT


def test_abort_forgets_the_transfer_and_drops_its_late_answer(decode: Decode) -> None:
    first = decode.reserve("req-abort", num_tokens=4, page_ids=[1])
    second = decode.reserve("req-after", num_tokens=4, page_ids=[2])
    with ZmqTransport(timeout_s=5) as tx:
        aborted = tx.send(decode.endpoint, *handoff(first, pages=[0]))
        tx.abort(aborted)
        with pytest.raises(KeyError):
            tx.poll(aborted)
        tx.abort(aborted)  # idempotent
        assert decode.outcomes.get(timeout=2) == ("req-abort", True)  # its ack is in flight, then dropped
        later = tx.send(decode.endpoint, *handoff(second, pages=[0]))
        assert wait_done(tx, later).state is TransferState.ACKED
        with pytest.raises(KeyError):
            tx.poll(aborted)


def test_malformed_transfer_is_refused_not_unpickled(decode: Decode) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(decode.endpoint)
        sock.send_multipart([msgspec.msgpack.encode({"transfer_id": "t-1", "manifest": "nope"}), b"", b""])
        assert sock.poll(2000)
        reply = msgspec.msgpack.decode(sock.recv(), type=TransferReply)
    finally:
        sock.close(0)
        ctx.term()
    assert reply.transfer_id == "t-1" and not reply.ok and reply.error is not None
    assert reply.error.kind == "TransferVerificationFailed" and "malformed transfer header" in reply.error.message
    assert decode.outcomes.empty()


def test_a_transport_refuses_a_second_thread() -> None:
    with ZmqTransport() as tx:
        tx.listen("tcp://127.0.0.1:0")
        errors: list[BaseException] = []

        def other() -> None:
            try:
                tx.recv(0)
            except RuntimeError as e:
                errors.append(e)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert errors and "one thread" in str(errors[0])

"""What a peer can do to a decode worker's KV port, and what a decode worker can read from prefill (issue 17):

- every field of a NIXL offer is range-checked before the claim: an offer out of range is refused and the live
  request keeps its reservation (today's main claimed first, then raised OverflowError out of the loop on a
  negative address and left the pages pinned with no answer);
- anything that fails after the claim ends in an error arrival: the request fails, its pages are scrubbed and freed;
- a KV arrival that does not name its reservation (forged reservation id or nonce) is refused, teaches the sender
  nothing, and the live request is then served by its real prefill worker, over both transports;
- a decode worker reads, through NIXL, only the pages offered to it and only while the offer lives: not prefill's
  pool, not another decode worker's offer, and zeros once its offer was answered.
A real decode worker (the tiny model) runs in this process; senders are real transports or raw ZeroMQ sockets.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from kvseal.lifecycle import State
from kvseal.transfer.base import TransferState, create_transport
from kvseal.transfer.manifest import PoolPages
from kvseal.transfer.nixl import NixlOffer, nixl_api, nixl_errors
from kvseal.transfer.zmq_wire import TransferHeader, TransferReply
from kvseal.wire.kvspec import KVSpec
from kvseal.wire.reservation import Reservation, new_nonce, new_reservation_id
from kvseal.worker.decode import DecodeWorker
from tests.helpers.kv_peers import PoolSpec, decode_worker, pump, reserve, wait_status
from tests.helpers.transports import KV_TRANSPORTS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def metadata() -> Iterator[tuple[str, bytes]]:
    """A real NIXL agent's metadata (a small registered buffer): an offer that loads, whatever else it says."""
    api = nixl_api()
    agent = api.nixl_agent("offer-maker", api.nixl_agent_config(backends=["UCX"]))
    buf = torch.ones(4096, dtype=torch.uint8)
    agent.register_memory([buf])
    yield "offer-maker", agent.get_agent_metadata()


@pytest.fixture
def nixl_decode() -> Iterator[DecodeWorker]:
    with decode_worker("nixl") as w:
        yield w


class RawPeer:
    """A DEALER on the decode worker's KV port that sends whatever frames a test writes."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def offer(self, w: DecodeWorker, rid: str, offer: NixlOffer) -> TransferReply:
        res = w.kv.reservations[rid]
        spec = PoolSpec.of(w.engine)
        k, v = spec.pool(3)
        m = spec.manifest(res, PoolPages(k, v, tuple(range(len(res.page_ids)))))
        header = msgspec.msgpack.encode(TransferHeader(transfer_id=f"t-{rid}", manifest=m))
        self.sock.send_multipart([header, msgspec.msgpack.encode(offer)])
        pump(w, lambda: bool(self.sock.poll(0)))
        return msgspec.msgpack.decode(self.sock.recv(), type=TransferReply)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def good_offer(w: DecodeWorker, agent: str, md: bytes, pages: int) -> NixlOffer:
    k = w.engine.pool.k
    block = k[0, 0].numel() * k.element_size()
    return NixlOffer(agent=agent, metadata=md, k_addr=0x7F0000000000, v_addr=0x7F0010000000, layers=k.shape[0],
                     pool_pages=16, block_bytes=block, page_ids=list(range(pages)), readable_s=10.0)


def untouched(w: DecodeWorker, rid: str) -> bool:
    d = w.engine
    pages = d.kv.reservations[rid].page_ids
    return (d.seqs[rid].life.state is State.RESERVED and rid not in d.kv.landing
            and not d.pool.k[:, pages].any() and not d.pool.v[:, pages].any())


def serve_for_real(w: DecodeWorker, rid: str, kind: str) -> None:
    """The request's real prefill worker sends its KV: acked, admitted, decoded to the end."""
    spec = PoolSpec.of(w.engine)
    with create_transport(kind, timeout_s=20.0) as tx:
        k, v = spec.pool(7)
        tx.register(k, v)
        src = PoolPages(k, v, tuple(range(10, 10 + len(w.kv.reservations[rid].page_ids))))
        h = tx.send(w.kv_endpoint, spec.manifest(w.kv.reservations[rid], src), src if kind == "nixl"
                    else src.pack())
        st = wait_status(tx, h, also=w.pump)
    assert st.state is TransferState.ACKED, st
    pump(w, lambda: rid not in w.engine.seqs)
    assert w.engine.allocator.num_free == w.engine.pool.num_pages


BAD_FIELDS: dict[str, tuple[Any, str]] = {
    "k_addr": (-4096, "k_addr"),  # today's main: OverflowError out of the loop, pages pinned, no answer
    "v_addr": (2**64 - 16, "v_addr"),
    "pool_pages": (2**40, "pool_pages"),
    "page_ids": ([0, 1, 16], "outside [0, 16)"),
    "layers": (7, "layers 7"),
    "block_bytes": (1, "block_bytes 1"),
    "readable_s": (float("nan"), "readable_s"),
}


@pytest.mark.parametrize("field", sorted(BAD_FIELDS))
def test_an_offer_out_of_range_is_refused_before_the_claim_and_harms_nothing(
        nixl_decode: DecodeWorker, metadata: tuple[str, bytes], field: str) -> None:
    w = nixl_decode
    res = reserve(w, "r")
    value, words = BAD_FIELDS[field]
    peer = RawPeer(w.kv_endpoint)
    try:
        reply = peer.offer(w, "r", msgspec.structs.replace(good_offer(w, *metadata, len(res.page_ids)),
                                                           **{field: value}))
    finally:
        peer.close()
    assert not reply.ok and reply.error is not None and reply.error.code == "kv_verification_failed"
    assert "out of range" in reply.error.message and words in reply.error.message, reply.error.message
    assert untouched(w, "r")
    serve_for_real(w, "r", "nixl")


@pytest.mark.parametrize("bad", ["garbage metadata", "another agent's metadata"])
def test_an_error_after_the_claim_fails_the_request_and_frees_its_pages(
        nixl_decode: DecodeWorker, metadata: tuple[str, bytes], bad: str) -> None:
    w, d = nixl_decode, nixl_decode.engine
    res = reserve(w, "r")
    offer = good_offer(w, *metadata, len(res.page_ids))
    offer = msgspec.structs.replace(offer, **({"metadata": b"\x00" * 64} if bad == "garbage metadata"
                                              else {"agent": "someone-else"}))
    peer = RawPeer(w.kv_endpoint)
    try:
        reply = peer.offer(w, "r", offer)
    finally:
        peer.close()
    assert not reply.ok and reply.error is not None and reply.error.code == "worker_failed", reply
    assert "r" not in d.seqs and not d.kv.landing and not d.kv.quarantined  # the request failed ...
    assert d.allocator.num_free == d.pool.num_pages and not d.pool.k.any()  # ... its pages scrubbed and freed
    assert w.info()["kv_reads_in_flight"] == 0


@pytest.mark.parametrize("kind", KV_TRANSPORTS)
@pytest.mark.parametrize("forged", ["nonce", "reservation_id"])
def test_a_forged_arrival_is_dropped_and_the_live_request_is_served(kind: str, forged: str) -> None:
    with decode_worker(kind) as w:
        res = reserve(w, "r")
        spec = PoolSpec.of(w.engine)
        fake = msgspec.structs.replace(res, **{forged: new_nonce() if forged == "nonce" else new_reservation_id()})
        with create_transport(kind, timeout_s=20.0) as forger:
            k, v = spec.pool(9)
            forger.register(k, v)
            src = PoolPages(k, v, tuple(range(len(res.page_ids))))
            h = forger.send(w.kv_endpoint, spec.manifest(fake, src), src if kind == "nixl" else src.pack())
            st = wait_status(forger, h, also=w.pump)
        assert st.state is TransferState.REJECTED and st.error is not None, st
        assert st.error.code == "kv_verification_failed" and forged in st.error.message
        assert res.nonce not in st.error.message and res.reservation_id not in st.error.message  # nothing learnt
        assert untouched(w, "r")
        serve_for_real(w, "r", kind)


@pytest.fixture
def two_decodes() -> Iterator[dict[str, zmq.Socket[bytes]]]:
    """The KV ports of decode workers A and B: ROUTER sockets a test reads offers from and answers on."""
    ctx = zmq.Context()
    routers: dict[str, zmq.Socket[bytes]] = {name: ctx.socket(zmq.ROUTER) for name in ("A", "B")}
    try:
        for s in routers.values():
            s.setsockopt(zmq.LINGER, 0)
            s.bind("tcp://127.0.0.1:0")
        yield routers
    finally:
        for s in routers.values():
            s.close(0)
        ctx.term()


def test_a_decode_worker_reads_only_the_pages_it_was_offered_while_the_offer_lives(
        two_decodes: dict[str, zmq.Socket[bytes]]) -> None:
    """Decode A gets an honest offer (metadata included) and reads with NIXL as it likes. It reads its offered pages;
    it cannot name prefill's pool nor B's offered pages (NIXL refuses descriptors its metadata does not cover, and
    only A's window is in it); once A answered, its window pages read as zeros."""
    api, errors = nixl_api(), nixl_errors()
    spec = PoolSpec(shape=(2, 16, 4, 2, 8), dtype="bfloat16", fingerprint="fp", page_size=4, kv_layout="L2")
    k, v = spec.pool(5)
    k = k.reshape(2, 16, 2, 8, 4)  # K as the kt layout keeps it (transposed inside a page), V as std
    routers = two_decodes
    ends = {name: s.getsockopt_string(zmq.LAST_ENDPOINT) for name, s in routers.items()}
    reader = api.nixl_agent("decode-A", api.nixl_agent_config(backends=["UCX"]))
    local_k, local_v = torch.zeros_like(k[:, :2]), torch.zeros_like(v[:, :2])
    reader.register_memory([local_k, local_v])
    with create_transport("nixl", timeout_s=30.0) as tx:
        tx.register(k, v)
        offers, handles = {}, {}
        for name, pages in (("B", (1,)), ("A", (3, 7))):  # B's window exists when A's metadata is made
            res = msgspec.structs.replace(reserve_like(spec, name, len(pages)), kv_endpoint=ends[name])
            src = PoolPages(k, v, pages)
            handles[name] = tx.send(ends[name], spec.manifest(res, src), src)
            ident, header, offer = routers[name].recv_multipart()
            offers[name] = (ident, msgspec.msgpack.decode(header, type=TransferHeader),
                            msgspec.msgpack.decode(offer, type=NixlOffer))
        a = offers["A"][2]
        peer = reader.add_remote_agent(a.metadata)
        local = reader.prep_xfer_dlist("NIXL_INIT_AGENT", blocks(local_k, local_v), "DRAM")

        def read(remote_blocks: Any, rows: list[int]) -> str:
            remote = reader.prep_xfer_dlist(peer, remote_blocks, "DRAM")
            x = reader.make_prepped_xfer("READ", local, rows_of(2, 2, [0, 1])[: len(rows)], remote, rows)
            state, deadline = reader.transfer(x), time.monotonic() + 30
            while state == "PROC" and time.monotonic() < deadline:
                tx.tend()  # as prefill's loop does: the sender progresses UCX so that a READ of its memory is served
                state = reader.check_xfer_state(x)
            assert state != "PROC", "a NIXL read of 2 pages did not end within 30 s"
            x.release()
            return str(state)

        window = window_blocks(a)
        assert read(window, rows_of(2, a.pool_pages, a.page_ids)) == "DONE"
        assert torch.equal(local_k, k[:, [3, 7]]) and torch.equal(local_v, v[:, [3, 7]])  # its offered pages
        for target in (blocks(k, v), window_blocks(offers["B"][2])):  # prefill's pool; B's offered pages
            with pytest.raises(errors):
                read(target, [0])
        routers["A"].send_multipart([offers["A"][0], msgspec.msgpack.encode(TransferReply(
            transfer_id=offers["A"][1].transfer_id, ok=True))])
        assert wait_status(tx, handles["A"]).state is TransferState.ACKED
        local_k.fill_(1)
        local_v.fill_(1)
        assert read(window, rows_of(2, a.pool_pages, a.page_ids)) == "DONE"
        assert not local_k.any() and not local_v.any()  # the offer ended: zeros, not the pages it held
        tx.abort(handles["B"])


def reserve_like(spec: PoolSpec, rid: str, pages: int) -> Reservation:
    return Reservation(request_id=rid, reservation_id=new_reservation_id(), nonce=new_nonce(),
                       num_tokens=pages * spec.page_size, page_ids=list(range(pages)),
                       kv=KVSpec(model_fingerprint=spec.fingerprint, page_size=spec.page_size, kv_dtype=spec.dtype,
                       kv_layout=spec.kv_layout), kv_endpoint="")


def block_list(k_addr: int, v_addr: int, layers: int, pages: int, block: int) -> np.ndarray:
    """NIXL descriptors (address, length, device) of every (side, layer, page) block of two regions."""
    lp = np.arange(layers * pages, dtype=np.uint64) * np.uint64(block)
    out = np.zeros((2 * layers * pages, 3), dtype=np.uint64)
    out[:, 0] = np.concatenate([lp + np.uint64(k_addr), lp + np.uint64(v_addr)])
    out[:, 1] = block
    return out


def blocks(k: torch.Tensor, v: torch.Tensor) -> np.ndarray:
    block = k[0, 0].numel() * k.element_size()
    return block_list(k.data_ptr(), v.data_ptr(), k.shape[0], k.shape[1], block)


def window_blocks(o: NixlOffer) -> np.ndarray:
    return block_list(o.k_addr, o.v_addr, o.layers, o.pool_pages, o.block_bytes)


def rows_of(layers: int, pages: int, page_ids: Any) -> list[int]:
    return [s * layers * pages + layer * pages + p for s in range(2) for layer in range(layers) for p in page_ids]

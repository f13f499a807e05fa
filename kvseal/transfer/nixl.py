"""KV over NIXL (UCX: RDMA where there is RDMA, else TCP or shared memory): decode reads the request's pages from
prefill's export window straight into the pages it reserved.

Decode reads (NIXL READ), prefill does not write. Prefill copies the offered pages out of its pool into its export
window for that decode worker (nixl_window.py: the only memory it registers, described to that worker alone) and
keeps them there until decode answers the transfer. Decode starts, watches and ends every byte movement into its
own pages: it pins the claimed pages while its read may move bytes, and frees them (scrubbed) only once NIXL says
the read is over (`check_xfer_state` is DONE or ERR), however long that takes. A read is never cancelled and its
pages are never freed on a timer: UCX cancels only tag receives, so an RMA GET keeps landing after its handle was
released. At the read's deadline decode ends the request (the client gets its 504 at once) with an arrival marked
`still_landing`; the pages stay out of the pool until the read is over, and only then is prefill answered, so
prefill's window pages too are zeroed and reused only when no read of them can still be running.

Control: the ZeroMQ channel of zmq.py (acks, nacks, timeouts, abort) carries one small frame per transfer:
    [TransferHeader (transfer id + KVManifest), NixlOffer (prefill's agent name, the partial metadata of its
     window for this decode worker, the window's geometry, the window pages to read)]
Data: a page of a pool (L, P, S, KVH, D) is L blocks of S * KVH * D elements, P blocks apart, per side (K, V);
decode's block list is prepared once, a window's once per peer, and a transfer is the READ of the blocks (side,
layer, page) of the offered window pages into the same blocks of the claimed pages. Every field of an offer is
range-checked before the claim (nixl_offer.py: a bad offer is refused and the reservation left untouched);
decode then claims the pages (`Claim`: the manifest must name the reservation, or no byte moves), verifies the page
checksums in place once the read is done (seal 4), and a read that fails (peer gone, link cut) or anything that
goes wrong after the claim ends in an Arrival with the error: the pages are scrubbed and freed, the request fails.

`pip install 'kvseal[nixl]'` (the `nixl` wheel from PyPI, with UCX inside; it runs on a CPU-only machine).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

import msgspec
import torch
import zmq

from kvseal.auth.keys import MemberKeys
from kvseal.errors import ErrorInfo, KvsealError, TransferTimeout, TransferVerificationFailed, WorkerFailed
from kvseal.transfer.base import Arrival, Claim, TransferHandle, TransferState, TransferStatus
from kvseal.transfer.manifest import KVManifest, PagePayload, PoolPages
from kvseal.transfer.nixl_offer import Geometry, NixlOffer, check_offer, geometry
from kvseal.transfer.nixl_reads import NixlReads, nixl_api, nixl_errors
from kvseal.transfer.nixl_window import Exports
from kvseal.transfer.zmq import ZmqTransport
from kvseal.transfer.zmq_wire import Frame, Mutate, Source

log = logging.getLogger("kvseal.transfer.nixl")
__all__ = ["NixlOffer", "NixlTransport", "nixl_api", "nixl_errors"]


class NixlTransport(ZmqTransport):
    """Sender and/or receiver: offers and answers over ZeroMQ, bytes by NIXL READ into the claimed pages.

    export_pages: pages of each receiver's export window (default: the pool's page count); an offer that finds too
    few free waits for the receiver's answers to free some, up to its timeout."""

    staged = False
    _num_frames = 2  # header, offer

    def __init__(self, *, timeout_s: float = 30.0, mutate: Mutate | None = None, hwm: int = 1000,
                 io_threads: int = 1, max_frame_bytes: int | None = 16 * 2**20, keepalive_idle_s: int = 30,
                 name: str | None = None, export_pages: int | None = None, keys: MemberKeys | None = None) -> None:
        api = nixl_api()
        super().__init__(timeout_s=timeout_s, mutate=mutate, hwm=hwm, io_threads=io_threads,
                         max_frame_bytes=max_frame_bytes, keepalive_idle_s=keepalive_idle_s, keys=keys,
                         encrypt=True)  # the offer names prefill's agent and pool: it crosses encrypted
        if export_pages is not None and export_pages < 1:
            raise ValueError(f"invalid NixlTransport(export_pages={export_pages}): give at least 1 page")
        self.name = name or f"kvseal-{secrets.token_hex(8)}"
        # No progress thread: NIXL's spins (sched_yield) and took half a core of an idle worker, a whole core of two
        # for a prefill and a decode worker on one 2-core host. Each side progresses UCX itself, only while a read
        # runs: decode through check_xfer_state in its loop, prefill (whose memory the READ takes; over TCP the
        # target must progress to serve it) through get_new_notifs in tend() while its window holds offered pages.
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._errors = nixl_errors()
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL has no UCX backend here: reinstall the nixl package")
        self._pools: tuple[torch.Tensor, torch.Tensor] | None = None
        self._geo: Geometry | None = None
        self._export_pages = export_pages
        self._exports: Exports | None = None  # a sender's export windows, made at its first send
        self._creds: dict[str, tuple[str | None, str | None]] = {}  # endpoint -> (its fleet key, KV session)
        self._registered = False  # the pool, with NIXL: only a receiver's, which reads into it
        self.reads: NixlReads | None = None  # a receiver's reads into its pool (transfer/nixl_reads.py)
        self._offer_enc = msgspec.msgpack.Encoder()
        self._offer_dec = msgspec.msgpack.Decoder(NixlOffer)

    def register(self, pool_k: torch.Tensor, pool_v: torch.Tensor) -> None:
        """Take the pool, once. Nothing is registered with NIXL yet: a receiver registers it when it listens
        (reads land there); a sender never does (peers read its export windows, never the pool)."""
        if self._pools is not None:
            raise RuntimeError("NixlTransport.register is called once per pool")
        self._geo = geometry(pool_k, pool_v)
        self._pools = (pool_k, pool_v)

    def listen(self, bind_endpoint: str) -> str:
        if self._pools is None:
            raise RuntimeError("NixlTransport.listen before register()")
        endpoint = super().listen(bind_endpoint)
        if not self._registered:
            self.agent.register_memory(list(self._pools))
            self._registered = True
            assert self._geo is not None
            self.reads = NixlReads(self.agent, self._geo, self.timeout_s)
        return endpoint

    # -- sender -----------------------------------------------------------------------------------------
    def send(self, endpoint: str, manifest: KVManifest, payload: PagePayload | PoolPages, *,
             timeout_s: float | None = None, server_key: str | None = None,
             session: str | None = None) -> TransferHandle:
        self._own()
        self._creds[endpoint] = (server_key, session)  # the offer may wait for window pages: _offer_ready posts it
        if self._pools is None or self._geo is None:
            raise RuntimeError("NixlTransport.send before register()")
        if not isinstance(payload, PoolPages) or payload.k.data_ptr() != self._geo.k_ptr:
            raise ValueError("NixlTransport sends pages of the pool it was given (PoolPages), not a packed copy")
        if self._mutate is not None:
            manifest, mutated = self._mutate(manifest, payload)
            assert isinstance(mutated, PoolPages)
            payload = mutated
        handle = TransferHandle(secrets.token_hex(8), endpoint, manifest.request_id)
        if self._exports is None:
            pages = self._export_pages or int(self._pools[0].shape[1])
            self._exports = Exports(self.agent, self.name, *self._pools, pages)
        try:
            self._exports.add(handle, manifest, payload, self.timeout_s if timeout_s is None else timeout_s)
        except self._errors as e:
            self._done[handle.transfer_id] = TransferStatus(TransferState.FAILED, WorkerFailed(
                f"no NIXL offer of request {manifest.request_id!r} to {endpoint}: {e}").to_info())
            return handle
        self._offer_ready()
        return handle

    def _offer_ready(self) -> None:
        """Make every offer that fits its window now."""
        if self._exports is None:
            return
        now = time.monotonic()
        for w, offer in self._exports.ready():
            tid = w.handle.transfer_id
            if isinstance(offer, Exception):
                log.warning("no NIXL offer of request %r: %s", w.handle.request_id, offer)
                self._done[tid] = TransferStatus(TransferState.FAILED, WorkerFailed(
                    f"the KV of request {w.handle.request_id!r} could not be offered over NIXL: "
                    f"{type(offer).__name__}: {offer}").to_info())
                continue
            self._post(w.handle, w.manifest, [self._offer_enc.encode(offer)], max(w.deadline - now, 1e-3),
                       *self._creds.get(w.handle.endpoint, (None, None)))
            if tid in self._done:  # never left this process: nobody can read its window pages
                self._exports.answered(w.handle.endpoint, tid)

    def poll(self, handle: TransferHandle) -> TransferStatus:
        self._own()
        waiting = self._exports.waiting if self._exports is not None else {}
        tid = handle.transfer_id
        self._serve_reads()
        if tid in waiting:
            self._drain(handle.endpoint)  # answers free window pages
            self._offer_ready()
        w = waiting.get(tid)
        if w is None:
            return super().poll(handle)
        if time.monotonic() < w.deadline:
            return TransferStatus(TransferState.PENDING)
        del waiting[tid]
        return TransferStatus(TransferState.TIMED_OUT, TransferTimeout(
            f"the KV of request {handle.request_id!r} waited {w.timeout:g}s for room in the NIXL export window for "
            f"{handle.endpoint}: its pages are held by offers the decode worker has not answered").to_info())

    def abort(self, handle: TransferHandle) -> None:
        self._own()
        if self._exports is not None:  # an offer made keeps its window pages until the receiver answers
            self._exports.waiting.pop(handle.transfer_id, None)
        super().abort(handle)

    def _serve_reads(self, holding: list[str] | None = None) -> None:
        """A READ of offered window pages may be running: progress UCX so that it is served (over TCP the target
        of a READ must progress; get_new_notifs does, and returns at once)."""
        if self._exports is not None and (holding if holding is not None else self._exports.holding()):
            self.agent.get_new_notifs()

    def _answered(self, endpoint: str, transfer_id: str) -> None:
        if self._exports is not None:
            self._exports.answered(endpoint, transfer_id)

    def tend(self) -> None:
        self._own()
        if self._exports is None:
            return
        holding = self._exports.holding()
        self._serve_reads(holding)
        for endpoint in holding:
            self._drain(endpoint)
        if self._exports.waiting:
            self._offer_ready()

    def _outgoing(self, handle: TransferHandle, manifest: KVManifest, payload: Source,
                  timeout_s: float) -> tuple[KVManifest, list[Frame]]:
        raise AssertionError("NixlTransport.send makes its offers itself")

    # -- receiver ---------------------------------------------------------------------------------------
    def _arrival(self, transfer_id: str, manifest: KVManifest, frames: list[zmq.Frame],
                 reply: Callable[[bool, ErrorInfo | None], bool], claim: Claim | None) -> Arrival | None:
        if claim is None or self._pools is None or self._geo is None:
            raise RuntimeError("NixlTransport.recv needs register() and a claim")
        try:
            offer = self._offer_dec.decode(frames[0].buffer)
        except msgspec.DecodeError as e:
            reply(False, TransferVerificationFailed(f"malformed NIXL offer: {e}").to_info())
            return None
        bad = check_offer(offer, manifest, self._geo)
        if bad:  # refused before the claim: the reservation is untouched
            reply(False, TransferVerificationFailed(
                f"the NIXL offer for request {manifest.request_id!r} is out of range: {'; '.join(bad)}").to_info())
            return None
        try:
            pages = list(claim(manifest))  # identity checked, pages pinned; a refusal moves no byte
        except KvsealError as err:
            reply(False, err.to_info())
            return None
        assert self.reads is not None  # listening: the pool is registered
        return self.reads.start(transfer_id, manifest, offer, PoolPages(*self._pools, tuple(pages)), reply)

    def _busy(self) -> bool:
        return bool(self.reads)

    def _progress(self) -> Arrival | None:
        return self.reads.progress() if self.reads is not None else None

    def figures(self) -> dict[str, int]:
        out = self.reads.figures() if self.reads is not None else {}
        return {**out, **(self._exports.figures() if self._exports is not None else {})}

    def close(self) -> None:
        """Reads not over keep their handles (and this object its pools): releasing one would not stop it."""
        if self._closed:
            return
        if self.reads is not None:
            self.reads.close()
        if self._exports is not None:
            try:
                self._exports.close()
            except self._errors as e:
                log.info("deregistering the export windows: %s", e)
        super().close()

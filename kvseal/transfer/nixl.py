"""KV over NIXL (UCX: RDMA where there is RDMA, else TCP or shared memory): decode reads prefill's pages
straight into the pages it reserved, with no staging copy on either side.

Decode reads (NIXL READ), prefill does not write. The receiver then starts, watches and ends every byte
movement into its own pages: it pins the claimed pages exactly while its read is in flight, and a read that
times out is cancelled before the pages are scrubbed and freed, so a late byte can never land in a page that
was given to someone else. A write from prefill could still be in flight when decode's reservation expires.
Prefill keeps its source pages owned by the request until decode answers or its transfer timeout passes; the
offer says how long that is, and decode gives up reading at half of it (counted from when it reads the offer:
an offer that waited long in decode's queue could be read after prefill freed its pages, and those bytes
cannot match the manifest's checksums, so verification refuses them and the pages are scrubbed).

Control: the ZeroMQ channel of zmq.py (acks, nacks, timeouts, abort) carries one small frame per transfer:
    [TransferHeader (transfer id + KVManifest), NixlOffer (prefill's agent name and metadata, its pool's
     geometry, the page ids to read)]
Data: each worker registers its KV pool once (`register`). A page of a pool (L, P, S, KVH, D) is L blocks of
S * KVH * D elements, P blocks apart, per side (K, V); each side's block list is prepared once (for a peer's
pool: once per peer), and a transfer is the READ of the blocks (side, layer, page) of the offered pages into
the same blocks of the claimed pages. Decode claims the pages first (`Claim`: the manifest must name the
reservation, or no byte moves), verifies the page checksums in place once the read is done (seal 4), and a
read that fails (peer gone, link cut) or times out ends in an Arrival with the error: the pages are scrubbed
and freed, and the request fails.

`pip install 'kvseal[nixl]'` (the `nixl` wheel from PyPI, with UCX inside; it runs on a CPU-only machine).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from kvseal.auth.keys import MemberKeys
from kvseal.errors import ErrorInfo, KvsealError, TransferTimeout, TransferVerificationFailed, WorkerFailed
from kvseal.transfer.base import Arrival, Claim, TransferHandle
from kvseal.transfer.manifest import SCHEMA_VERSION, KVManifest, PoolPages, page_nbytes
from kvseal.transfer.zmq import Frame, Mutate, Source, ZmqTransport

log = logging.getLogger("kvseal.transfer.nixl")


class NixlOffer(msgspec.Struct, frozen=True, kw_only=True):
    agent: str  # prefill's NIXL agent name (unique per process)
    metadata: bytes  # its agent metadata (connection info + registered pool), loaded once per agent
    k_addr: int  # prefill's registered K and V pools (NIXL checks every read against its registered memory)
    v_addr: int
    layers: int
    pool_pages: int  # pages in prefill's pool: page ids are checked against it before any read
    block_bytes: int  # bytes of one (layer, page) block; must equal the reader's
    page_ids: list[int]  # prefill's pages, in token order
    readable_s: float  # prefill keeps them for this long; decode gives up reading at half of it
    v: int = SCHEMA_VERSION


def nixl_api() -> ModuleType:
    try:
        from nixl import _api  # type: ignore[import-not-found]
    except ImportError as e:
        raise RuntimeError(f"--kv-transport nixl needs the nixl package: pip install 'kvseal[nixl]' ({e})") from e
    return _api


def nixl_errors() -> tuple[type[BaseException], ...]:
    """What NIXL raises (nixlBackendError, nixlNotFoundError, ...), plus the Python wrapper's own errors."""
    from nixl import _bindings  # type: ignore[import-not-found]

    found = [getattr(_bindings, n) for n in dir(_bindings) if n.startswith("nixl") and n.endswith("Error")]
    return (*[e for e in found if isinstance(e, type) and issubclass(e, BaseException)], ValueError, RuntimeError)


@dataclass(frozen=True, slots=True)
class _Geometry:
    k_ptr: int
    v_ptr: int
    layers: int
    pages: int
    block: int  # bytes of one (layer, page) block

    def blocks(self) -> np.ndarray:
        """(2 * L * P, 3) descriptors (address, length, device 0); row s*L*P + l*P + p is block (side, l, p)."""
        lp = np.arange(self.layers * self.pages, dtype=np.uint64) * np.uint64(self.block)
        addr = np.concatenate([lp + np.uint64(self.k_ptr), lp + np.uint64(self.v_ptr)])
        out = np.zeros((addr.size, 3), dtype=np.uint64)
        out[:, 0], out[:, 1] = addr, self.block
        return out

    def rows(self, page_ids: Sequence[int]) -> np.ndarray:
        """Descriptor rows of the pages' blocks in (side, layer, page) order: runs of adjacent pages stay
        adjacent, so NIXL can merge them into one larger read."""
        pages = np.asarray(page_ids, dtype=np.int64)
        per_layer = np.arange(2 * self.layers, dtype=np.int64)[:, None] * self.pages
        return (per_layer + pages[None, :]).reshape(-1).astype(np.int32)


@dataclass(slots=True)
class _Read:
    manifest: KVManifest
    landed: PoolPages
    handle: Any  # nixl_xfer_handle
    deadline: float
    reply: Callable[[bool, ErrorInfo | None], bool]
    peer: str
    cancelling: bool = False


def _remote(offer: NixlOffer) -> _Geometry:
    return _Geometry(offer.k_addr, offer.v_addr, offer.layers, offer.pool_pages, offer.block_bytes)


def _geometry(k: torch.Tensor, v: torch.Tensor) -> _Geometry:
    if k.device.type != "cpu" or v.device.type != "cpu" or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("NixlTransport registers contiguous CPU pools (L, P, ...) only")
    layers, pages = int(k.shape[0]), int(k.shape[1])
    return _Geometry(k.data_ptr(), v.data_ptr(), layers, pages, page_nbytes(k) // max(layers, 1))


class NixlTransport(ZmqTransport):
    """Sender and/or receiver: offers and answers over ZeroMQ, bytes by NIXL READ into the claimed pages."""

    staged = False
    _num_frames = 2  # header, offer

    def __init__(self, *, timeout_s: float = 30.0, mutate: Mutate | None = None, hwm: int = 1000,
                 io_threads: int = 1, max_frame_bytes: int | None = 16 * 2**20, keepalive_idle_s: int = 30,
                 name: str | None = None, keys: MemberKeys | None = None) -> None:
        api = nixl_api()
        super().__init__(timeout_s=timeout_s, mutate=mutate, hwm=hwm, io_threads=io_threads,
                         max_frame_bytes=max_frame_bytes, keepalive_idle_s=keepalive_idle_s, keys=keys,
                         encrypt=True)  # the offer names prefill's agent and pool: it crosses encrypted
        self.name = name or f"kvseal-{secrets.token_hex(8)}"
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=["UCX"]))
        self._errors = nixl_errors()
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL has no UCX backend here: reinstall the nixl package")
        self._pools: tuple[torch.Tensor, torch.Tensor] | None = None
        self._geo: _Geometry | None = None
        self._metadata = b""
        self._local: Any = None  # this pool's prepared block list (receiver)
        self._peers: dict[str, Any] = {}  # agent name -> its pool's prepared block list
        self._reads: dict[str, _Read] = {}  # transfer id -> a read in flight (its pages pinned by the claim)
        self._offer_enc = msgspec.msgpack.Encoder()
        self._offer_dec = msgspec.msgpack.Decoder(NixlOffer)

    def register(self, pool_k: torch.Tensor, pool_v: torch.Tensor) -> None:
        """Register the pool with NIXL, once: its memory is what peers read from (prefill) or into (decode)."""
        if self._pools is not None:
            raise RuntimeError("NixlTransport.register is called once per pool")
        self._geo = _geometry(pool_k, pool_v)
        self.agent.register_memory([pool_k, pool_v])
        self._pools = (pool_k, pool_v)
        self._metadata = self.agent.get_agent_metadata()

    # -- sender -----------------------------------------------------------------------------------------
    def _outgoing(self, handle: TransferHandle, manifest: KVManifest, payload: Source,
                  timeout_s: float) -> tuple[KVManifest, list[Frame]]:
        if self._pools is None or self._geo is None:
            raise RuntimeError("NixlTransport.send before register()")
        if not isinstance(payload, PoolPages) or payload.k.data_ptr() != self._geo.k_ptr:
            raise ValueError("NixlTransport sends pages of its registered pool (PoolPages), not a packed copy")
        if self._mutate is not None:
            manifest, mutated = self._mutate(manifest, payload)
            assert isinstance(mutated, PoolPages)
            payload = mutated
        offer = NixlOffer(agent=self.name, metadata=self._metadata, k_addr=self._geo.k_ptr,
                          v_addr=self._geo.v_ptr, layers=self._geo.layers,
                          pool_pages=self._geo.pages, block_bytes=self._geo.block,
                          page_ids=list(payload.page_ids), readable_s=timeout_s)
        return manifest, [self._offer_enc.encode(offer)]

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
        try:
            pages = list(claim(manifest))  # identity checked, pages pinned; a refusal moves no byte
        except KvsealError as err:
            reply(False, err.to_info())
            return None
        landed = PoolPages(*self._pools, tuple(pages))

        def failed(err: KvsealError) -> Arrival:
            return Arrival(transfer_id, manifest, None, reply, error=err.to_info())

        geo = self._geo
        if (offer.v != SCHEMA_VERSION or offer.layers != geo.layers or offer.block_bytes != geo.block
                or len(offer.page_ids) != len(pages) or any(not 0 <= p < offer.pool_pages for p in offer.page_ids)):
            return failed(TransferVerificationFailed(
                f"KV offer for request {manifest.request_id!r} does not fit its reservation: {len(offer.page_ids)} "
                f"pages of {offer.layers} x {offer.block_bytes} bytes (ids below {offer.pool_pages}), reserved "
                f"{len(pages)} pages of {geo.layers} x {geo.block} bytes"))
        try:
            remote = self._peer(offer)
            if self._local is None:
                self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", geo.blocks(), "DRAM")
            xfer = self.agent.make_prepped_xfer("READ", self._local, geo.rows(pages), remote,
                                                _remote(offer).rows(offer.page_ids))
            state = self.agent.transfer(xfer)
        except self._errors as e:  # the read never started
            log.warning("NIXL read of request %r from %s could not start: %s", manifest.request_id, offer.agent, e)
            return failed(WorkerFailed(f"the KV of request {manifest.request_id!r} could not be read from the "
                                       f"prefill worker ({offer.agent}) over NIXL: {e}"))
        if state == "ERR":
            xfer.release()
            return failed(WorkerFailed(f"the NIXL read of request {manifest.request_id!r}'s KV from "
                                       f"{offer.agent} failed at once"))
        budget = min(self.timeout_s, offer.readable_s / 2)
        self._reads[transfer_id] = _Read(manifest, landed, xfer, time.monotonic() + budget, reply, offer.agent)
        return None

    def _peer(self, offer: NixlOffer) -> Any:
        prepped = self._peers.get(offer.agent)
        if prepped is None:
            loaded = self.agent.add_remote_agent(offer.metadata)
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != offer.agent:
                raise ValueError(f"the offer names agent {offer.agent!r} but its metadata is {name!r}'s")
            prepped = self.agent.prep_xfer_dlist(name, _remote(offer).blocks(), "DRAM")
            self._peers[offer.agent] = prepped
        return prepped

    def _busy(self) -> bool:
        return bool(self._reads)

    def _progress(self) -> Arrival | None:
        now = time.monotonic()
        for tid, r in list(self._reads.items()):
            if r.cancelling:
                if not self._release(r):
                    continue
                del self._reads[tid]
                return self._ended(tid, r, TransferTimeout(
                    f"the KV of request {r.manifest.request_id!r} did not arrive over NIXL (failed or too late); "
                    f"the read was cancelled and the pages released"))
            state = self.agent.check_xfer_state(r.handle)
            if state == "DONE":
                del self._reads[tid]
                r.handle.release()
                return Arrival(tid, r.manifest, None, r.reply, landed=r.landed)
            if state == "ERR":
                if not self._release(r):  # not let go of yet: keep the pages pinned and ask again
                    r.cancelling = True
                    continue
                del self._reads[tid]
                self._forget_peer(r.peer)
                return self._ended(tid, r, WorkerFailed(
                    f"the NIXL read of request {r.manifest.request_id!r}'s KV from {r.peer} failed (the prefill "
                    f"worker is gone or the link is down)"))
            if now >= r.deadline:
                r.cancelling = True  # from here on the pages stay pinned until NIXL lets go of the read
                if self._release(r):
                    del self._reads[tid]
                    return self._ended(tid, r, TransferTimeout(
                        f"the KV of request {r.manifest.request_id!r} did not arrive over NIXL in time; the read "
                        f"was cancelled and the pages released"))
        return None

    def _release(self, r: _Read) -> bool:
        """Release (cancelling if need be) a read; False while NIXL cannot let go of it yet."""
        try:
            r.handle.release()
        except self._errors as e:
            log.info("NIXL read of request %r not released yet: %s", r.manifest.request_id, e)
            return False
        return True

    def _ended(self, tid: str, r: _Read, err: KvsealError) -> Arrival:
        return Arrival(tid, r.manifest, None, r.reply, error=err.to_info())

    def _forget_peer(self, agent: str) -> None:
        prepped = self._peers.pop(agent, None)
        if prepped is None:
            return
        try:
            prepped.release()
            self.agent.remove_remote_agent(agent)
        except self._errors as e:
            log.info("forgetting NIXL peer %s: %s", agent, e)

    def close(self) -> None:
        if self._closed:
            return
        for r in self._reads.values():
            self._release(r)
        self._reads.clear()
        super().close()

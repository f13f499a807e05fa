"""Prefill's export window for one decode worker: the only memory of the prefill process that NIXL registers for it.

Why a window and not the pool: on UCX's TCP and shared-memory transports the target of a READ checks nothing (the
GET is served from whatever address the reader names, registered or not, before or after deregistration; see
docs/architecture.md, "What a NIXL peer can read"). Only RDMA NICs check a remote key against a registered region.
So kvseal never registers the prefill pool and never describes it to a peer. To offer a request's pages, prefill
copies them into free pages (slots) of this window, which has the pool's layout (L, W, S, KVH, D) and is
registered once; the decode worker gets partial NIXL metadata that describes this window alone, so through NIXL
it can name no other address of the prefill process (NIXL refuses the descriptors), and with RDMA the NIC refuses
them too. A slot holds offered bytes from the offer until the decode worker answers the transfer (it acks after
its read is done, or nacks once its read is known to be over), then it is zeroed and free again: whatever reads
a slot after its offer ended gets zeros or a later offer to the same decode worker, never another worker's pages.
A read that never ends keeps its slots held (reported as export pages held), never freed on a timer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvseal.transfer.base import TransferHandle
from kvseal.transfer.manifest import KVManifest, PoolPages
from kvseal.transfer.nixl_offer import Geometry, NixlOffer, geometry


class ExportWindow:
    """`pages` slots with the pool's page shape, registered with `agent`; slots held per transfer id."""

    def __init__(self, agent: Any, pool_k: torch.Tensor, pool_v: torch.Tensor, pages: int) -> None:
        if pages < 1:
            raise ValueError(f"an export window needs at least one page, got {pages}")
        # each side keeps its pool's page shape (the kt layout transposes K inside a page, not V)
        self.k = torch.zeros((pool_k.shape[0], pages, *pool_k.shape[2:]), dtype=pool_k.dtype)
        self.v = torch.zeros((pool_v.shape[0], pages, *pool_v.shape[2:]), dtype=pool_v.dtype)
        self.geo: Geometry = geometry(self.k, self.v)
        self._agent = agent
        self._descs = agent.register_memory([self.k, self.v])
        self.metadata: bytes = agent.get_partial_agent_metadata(self._descs, True)  # this window only
        self._free = np.ones(pages, dtype=bool)
        self.held: dict[str, tuple[list[int], float]] = {}  # transfer id -> (its slots, the sender's deadline)

    @property
    def pages(self) -> int:
        return self.geo.pages

    @property
    def num_free(self) -> int:
        return int(self._free.sum())

    def take(self, transfer_id: str, pool_k: torch.Tensor, pool_v: torch.Tensor, page_ids: Sequence[int],
             deadline: float) -> list[int] | None:
        """Copy the pool's pages into free slots held for `transfer_id`; None (nothing taken) if too few are free.
        A run of adjacent slots when there is one, so NIXL can merge the blocks into larger reads."""
        if transfer_id in self.held:
            raise ValueError(f"transfer {transfer_id} already holds export pages")
        slots = self._pick(len(page_ids))
        if slots is None:
            return None
        self._free[slots] = False
        self.held[transfer_id] = (slots, deadline)
        try:
            for win, pool in ((self.k, pool_k), (self.v, pool_v)):
                copy_pages(page_blocks(pool), list(page_ids), page_blocks(win), slots)
        except Exception:
            self.give_back(transfer_id)  # nothing was offered from them
            raise
        return slots

    def give_back(self, transfer_id: str) -> int:
        """The receiver is done with the transfer: zero its slots, free them. Returns how many (0: none held)."""
        entry = self.held.pop(transfer_id, None)
        if entry is None:
            return 0
        slots = entry[0]
        for win in (self.k, self.v):
            blocks = page_blocks(win)
            for start, _, n in _runs(slots, slots):
                blocks[:, start:start + n].zero_()
        self._free[slots] = True
        return len(slots)

    def overdue(self, now: float) -> int:
        """Slots held by transfers whose sender gave up on the answer (its deadline passed) and still unanswered."""
        return sum(len(slots) for slots, deadline in self.held.values() if now >= deadline)

    def close(self) -> None:
        """Deregister the window (at process end: reads still in flight may then fail on RDMA; TCP ignores it)."""
        self._agent.deregister_memory(self._descs)

    def _pick(self, n: int) -> list[int] | None:
        if n > self.num_free:
            return None
        if n == 0:
            return []
        csum = np.concatenate([[0], np.cumsum(self._free, dtype=np.int64)])
        runs = np.nonzero(csum[n:] - csum[:-n] == n)[0]
        if runs.size:
            start = int(runs[0])
            return list(range(start, start + n))
        return [int(i) for i in np.nonzero(self._free)[0][:n]]


def page_blocks(pool: torch.Tensor) -> torch.Tensor:
    """A pool (L, P, ...) as (L, P, words): one (layer, page) block a row of the widest word that divides it."""
    flat = pool.reshape(pool.shape[0], pool.shape[1], -1).view(torch.uint8)
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if flat.shape[2] % size == 0 and flat.data_ptr() % size == 0:
            return flat.view(dtype)
    return flat


def _runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first dst, first src, length) of the stretches where both page lists go up by one."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out and out[-1][0] + out[-1][2] == d and out[-1][1] + out[-1][2] == s:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((d, s, 1))
    return out


def copy_pages(src: torch.Tensor, src_pages: list[int], dst: torch.Tensor, dst_pages: list[int]) -> None:
    """dst[:, dst_pages[j]] = src[:, src_pages[j]] for (L, P, words) blocks: a slice copy per run of adjacent
    pages on both sides (about 5x faster than a gather into a temporary), a gather where pages are scattered."""
    runs = _runs(src_pages, dst_pages)
    if len(runs) * 8 <= len(src_pages):
        for d, s, n in runs:
            dst[:, d:d + n].copy_(src[:, s:s + n])
    elif src_pages:
        idx = torch.tensor(dst_pages, dtype=torch.long)
        dst.index_copy_(1, idx, src.index_select(1, torch.tensor(src_pages, dtype=torch.long)))


@dataclass(slots=True)
class Waiting:
    """An offer not made yet: its receiver's window has too few free pages."""

    handle: TransferHandle
    manifest: KVManifest
    pages: PoolPages  # the pool pages to copy into the window
    timeout: float
    deadline: float  # the sender's: past it, the transfer times out without a byte exposed


class Exports:
    """A sender's export windows, one per receiver endpoint (made at the first offer to it), and the offers waiting
    for room in them, in the order they were sent."""

    def __init__(self, agent: Any, agent_name: str, pool_k: torch.Tensor, pool_v: torch.Tensor, pages: int) -> None:
        self._agent, self._name, self._pools, self._pages = agent, agent_name, (pool_k, pool_v), pages
        self.windows: dict[str, ExportWindow] = {}
        self.waiting: dict[str, Waiting] = {}  # transfer id -> its offer, not made yet

    def add(self, handle: TransferHandle, manifest: KVManifest, pages: PoolPages, timeout: float) -> None:
        """Queue an offer. Raises ValueError if its window could never hold it (and NIXL's errors)."""
        window = self.window(handle.endpoint)
        if pages.num_pages > window.pages:
            raise ValueError(f"the KV of request {manifest.request_id!r} ({pages.num_pages} pages) does not fit the "
                             f"NIXL export window for {handle.endpoint} ({window.pages} pages): give the prefill "
                             f"worker a window of at least {pages.num_pages} pages")
        self.waiting[handle.transfer_id] = Waiting(handle, manifest, pages, timeout, time.monotonic() + timeout)

    def window(self, endpoint: str) -> ExportWindow:
        w = self.windows.get(endpoint)
        if w is None:
            w = self.windows[endpoint] = ExportWindow(self._agent, *self._pools, self._pages)
        return w

    def ready(self) -> Iterator[tuple[Waiting, NixlOffer | Exception]]:
        """Copy every waiting offer that fits now into its window (in order) and yield it with its offer frame, or
        with the error that stopped the copy (nothing of it is held then)."""
        for tid, w in list(self.waiting.items()):
            window = self.windows[w.handle.endpoint]
            try:
                slots = window.take(tid, w.pages.k, w.pages.v, w.pages.page_ids, w.deadline)
            except Exception as e:  # noqa: BLE001 - fails this offer only
                del self.waiting[tid]
                yield w, e
                continue
            if slots is None:
                continue
            del self.waiting[tid]
            g = window.geo
            yield w, NixlOffer(agent=self._name, metadata=window.metadata, k_addr=g.k_ptr, v_addr=g.v_ptr,
                               layers=g.layers, pool_pages=g.pages, block_bytes=g.block, page_ids=slots,
                               readable_s=w.timeout)

    def answered(self, endpoint: str, transfer_id: str) -> None:
        """The receiver answered (or the offer never left): its window pages are zeroed and free."""
        window = self.windows.get(endpoint)
        if window is not None:
            window.give_back(transfer_id)

    def holding(self) -> list[str]:
        """Endpoints whose windows hold offered pages: their answers are awaited."""
        return [endpoint for endpoint, w in self.windows.items() if w.held]

    def figures(self) -> dict[str, int]:
        now = time.monotonic()
        return {"kv_export_pages_held": sum(w.pages - w.num_free for w in self.windows.values()),
                "kv_export_pages_overdue": sum(w.overdue(now) for w in self.windows.values()),
                "kv_offers_waiting": len(self.waiting)}

    def close(self) -> None:
        for w in self.windows.values():
            w.close()

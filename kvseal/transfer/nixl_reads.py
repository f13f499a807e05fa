"""Decode's NIXL reads (transfer/nixl.py): each READ of offered window pages into claimed pages, from its start to
the end NIXL reports. A read is over only when `check_xfer_state` says DONE or ERR (a peer gone counts as ERR): it is
never cancelled (UCX cancels only tag receives; a GET keeps landing after its handle is released) and never ended on
a timer. At its deadline the request ends (an arrival marked `still_landing`); its pages stay claimed until the read
is over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvseal.errors import ErrorInfo, KvsealError, TransferTimeout, WorkerFailed
from kvseal.transfer.base import Arrival
from kvseal.transfer.manifest import KVManifest, PoolPages
from kvseal.transfer.nixl_offer import Geometry, NixlOffer, offered

log = logging.getLogger("kvseal.transfer.nixl")


def nixl_api() -> ModuleType:
    try:
        from nixl import _api  # type: ignore[import-not-found]
    except ImportError as e:
        raise ValueError(f"invalid --kv-transport=nixl: the nixl package is not installed ({e}); "
                         "pip install 'kvseal[nixl]', or use --kv-transport zmq") from e
    return _api


def nixl_errors() -> tuple[type[BaseException], ...]:
    """What NIXL raises (nixlBackendError, nixlNotFoundError, ...), plus the Python wrapper's own errors."""
    from nixl import _bindings  # type: ignore[import-not-found]

    found = [getattr(_bindings, n) for n in dir(_bindings) if n.startswith("nixl") and n.endswith("Error")]
    return (*[e for e in found if isinstance(e, type) and issubclass(e, BaseException)], ValueError, RuntimeError)


def nixl_disconnected() -> tuple[type[BaseException], ...]:
    """What NIXL raises for a peer that is gone (nixlRemoteDisconnectError, NIXL_ERR_REMOTE_DISCONNECT)."""
    from nixl import _bindings

    found = getattr(_bindings, "nixlRemoteDisconnectError", None)
    return (found,) if isinstance(found, type) and issubclass(found, BaseException) else ()


@dataclass(slots=True)
class _Read:
    manifest: KVManifest
    landed: PoolPages
    handle: Any  # nixl_xfer_handle; released only once NIXL says the read is over
    deadline: float
    reply: Callable[[bool, ErrorInfo | None], bool]
    peer: str
    expired_at: float | None = None  # when the request was ended at the deadline (the read still running)
    unknown_logged: bool = False  # check_xfer_state raised once: said so in the log


class NixlReads:
    """The reads of one receiver's NIXL agent, into its registered pool (geometry `geo`)."""

    def __init__(self, agent: Any, geo: Geometry, timeout_s: float) -> None:
        self.agent, self.geo, self.timeout_s = agent, geo, timeout_s
        self._errors = nixl_errors()
        self._disconnected = nixl_disconnected()
        self._local: Any = None  # this pool's prepared block list
        self._peers: dict[str, tuple[Any, Geometry]] = {}  # agent -> its window's prepared block list, geometry
        self._reads: dict[str, _Read] = {}  # transfer id -> a read not over yet (its pages claimed)

    def __len__(self) -> int:
        return len(self._reads)

    def start(self, transfer_id: str, manifest: KVManifest, offer: NixlOffer, landed: PoolPages,
              reply: Callable[[bool, ErrorInfo | None], bool]) -> Arrival | None:
        """READ the offered pages into `landed` (claimed): an Arrival if it is over at once or could not start."""
        xfer = None
        try:
            remote = self._peer(offer)
            if self._local is None:
                self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.geo.blocks(), "DRAM")
            xfer = self.agent.make_prepped_xfer("READ", self._local, self.geo.rows(list(landed.page_ids)), remote,
                                                offered(offer).rows(offer.page_ids))
            state = self.agent.transfer(xfer)
        except Exception as e:  # noqa: BLE001 - after the claim, anything ends in an error arrival
            if xfer is not None and self._state(xfer) != "ERR":  # posted after all: watch it to its end
                state = "PROC"
            else:
                log.warning("NIXL read of request %r from %s could not start: %s", manifest.request_id,
                            offer.agent, e)
                self._let_go(xfer)
                return Arrival(transfer_id, manifest, None, reply, error=WorkerFailed(
                    f"the KV of request {manifest.request_id!r} could not be read from the prefill worker "
                    f"({offer.agent}) over NIXL: {type(e).__name__}: {e}").to_info())
        budget = min(self.timeout_s, offer.readable_s / 2)
        self._reads[transfer_id] = _Read(manifest, landed, xfer, time.monotonic() + budget, reply, offer.agent)
        return self._ended(transfer_id, state) if state in ("DONE", "ERR") else None

    def progress(self) -> Arrival | None:
        """The next read that ended, or whose deadline passed (then marked still landing), if any."""
        now = time.monotonic()
        for tid, r in list(self._reads.items()):
            state = self._state(r.handle, r)
            if state in ("DONE", "ERR"):
                return self._ended(tid, state)
            if r.expired_at is None and now >= r.deadline:
                r.expired_at = now  # the request ends now; its pages stay claimed until the read is over
                return Arrival(tid, r.manifest, None, r.reply, still_landing=True, error=TransferTimeout(
                    f"the KV of request {r.manifest.request_id!r} did not arrive over NIXL in time; the read "
                    f"still runs, and its pages stay out of the pool until it is over").to_info())
        return None

    def figures(self) -> dict[str, int]:
        overdue = [r for r in self._reads.values() if r.expired_at is not None]
        return {"kv_reads_in_flight": len(self._reads), "kv_reads_overdue": len(overdue),
                "kv_read_pages_overdue": sum(r.landed.num_pages for r in overdue)}

    def close(self) -> None:
        """Let go of the reads that are over; those not over keep their handles (releasing one would not stop it)."""
        for tid in [t for t, r in self._reads.items() if self._state(r.handle) in ("DONE", "ERR")]:
            self._let_go(self._reads.pop(tid).handle)

    def _peer(self, offer: NixlOffer) -> Any:
        known = self._peers.get(offer.agent)
        if known is not None:
            if known[1] != offered(offer):
                raise ValueError(f"agent {offer.agent!r} offered another export window than before")
            return known[0]
        loaded = self.agent.add_remote_agent(offer.metadata)
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name != offer.agent:
            raise ValueError(f"the offer names agent {offer.agent!r} but its metadata is {name!r}'s")
        prepped = self.agent.prep_xfer_dlist(name, offered(offer).blocks(), "DRAM")
        self._peers[offer.agent] = (prepped, offered(offer))
        return prepped

    def _state(self, xfer: Any, r: _Read | None = None) -> str:
        """DONE, ERR, PROC, or UNKNOWN when NIXL cannot say (then the read counts as running).

        A remote that is disconnected counts as ERR: the peer process is gone (or its endpoint closed), and with
        it its registered memory, so no byte of this read can land any more."""
        try:
            return str(self.agent.check_xfer_state(xfer))
        except self._disconnected:
            return "ERR"
        except self._errors as e:
            if r is None or not r.unknown_logged:
                log.warning("cannot tell whether a NIXL read is over (%s): its pages stay claimed", e)
            if r is not None:
                r.unknown_logged = True
            return "UNKNOWN"

    def _ended(self, tid: str, state: str) -> Arrival:
        """NIXL says the read is over (DONE or ERR): nothing can land any more. Let go of it and report."""
        r = self._reads.pop(tid)
        self._let_go(r.handle)
        if state == "DONE" and r.expired_at is None:
            return Arrival(tid, r.manifest, None, r.reply, landed=r.landed)
        if state == "DONE" and r.expired_at is not None:
            err: KvsealError = TransferTimeout(
                f"the KV of request {r.manifest.request_id!r} arrived over NIXL "
                f"{time.monotonic() - r.expired_at:.1f}s after the request had ended; its pages are freed now")
        else:
            if not any(x.peer == r.peer for x in self._reads.values()):
                self._forget_peer(r.peer)
            err = WorkerFailed(f"the NIXL read of request {r.manifest.request_id!r}'s KV from {r.peer} failed "
                               f"(the prefill worker is gone or the link is down)")
        return Arrival(tid, r.manifest, None, r.reply, error=err.to_info())

    def _let_go(self, xfer: Any) -> None:
        """Release the handle of a read that is over (or never started)."""
        if xfer is None:
            return
        try:
            xfer.release()
        except self._errors as e:
            log.info("releasing a finished NIXL read: %s", e)

    def _forget_peer(self, agent: str) -> None:
        known = self._peers.pop(agent, None)
        if known is None:
            return
        try:
            known[0].release()
            self.agent.remove_remote_agent(agent)
        except self._errors as e:
            log.info("forgetting NIXL peer %s: %s", agent, e)

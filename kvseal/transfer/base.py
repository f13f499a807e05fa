"""The transport interface: how KV pages + manifest get from a prefill worker to a decode worker.

Small on purpose (after SGLang's `send / poll / abort` and its status enum). A transport moves bytes and
carries back an ack or a nack; it never judges what it moves: verification is `transfer/verify.py`, run by the
receiver before it calls `Arrival.reply`.

Sender side:   register(pool_k, pool_v); h = send(endpoint, manifest, pages); poll(h) until done; abort(h)
Receiver side: register(pool_k, pool_v); endpoint = listen(bind); a = recv(timeout_s, claim); a.reply(ok, error)

Two kinds of transport. A staging one (`staged = True`, ZeroMQ) moves a packed copy of the pages; its
arrival carries that `payload`, which the receiver verifies and only then copies into the reserved pages. An
in-place one (`staged = False`, NIXL) moves the bytes straight into the reserved pages: before a byte moves it
asks `claim(manifest)` for them (the receiver checks the manifest's identity against its reservation and pins
the pages: they cannot expire or be freed while bytes may land), and its arrival says the bytes `landed` there,
or carries the `error` that stopped them (the receiver then scrubs and frees the claimed pages). A read that
outlives its deadline first gives an error arrival with `still_landing` set: the receiver ends the request then
(the client is not held hostage) but keeps the pages claimed and does not answer; a second arrival for the same
transfer follows once the transport knows that nothing can land any more, however long that takes, and only that
one frees the pages and is answered (the sender keeps what it offered until that answer).

Threading: an instance, and every Arrival it returns, is used from one thread only (the thread that first
uses it); other threads get RuntimeError. Run one instance per thread if you need several.
"""

from __future__ import annotations

import enum
import importlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Self

import torch

from kvseal.errors import ErrorInfo, KvsealError
from kvseal.transfer.manifest import KVManifest, PagePayload, PoolPages

# The receiver's reserved page ids for an arriving manifest; raises a KvsealError (the nack's error) to refuse
# it before any byte lands. Once it returned, the pages are pinned until the arrival that follows is handled.
Claim = Callable[[KVManifest], Sequence[int]]


class TransferState(enum.Enum):
    PENDING = "pending"  # sent (or queued); no answer yet
    ACKED = "acked"  # the receiver verified the pages and owns them now
    REJECTED = "rejected"  # the receiver refused them; error is the receiver's (e.g. TransferVerificationFailed)
    FAILED = "failed"  # the transport could not send (queue full, socket error); error says why
    TIMED_OUT = "timed_out"  # no answer within the timeout; error is a TransferTimeout


@dataclass(frozen=True, slots=True)
class TransferStatus:
    state: TransferState
    error: ErrorInfo | None = None  # set exactly when state is REJECTED, FAILED or TIMED_OUT

    @property
    def done(self) -> bool:
        return self.state is not TransferState.PENDING

    def raise_for_error(self) -> None:
        if self.error is not None:
            raise KvsealError.from_info(self.error)


@dataclass(frozen=True, slots=True)
class TransferHandle:
    transfer_id: str
    endpoint: str
    request_id: str


class Arrival:
    """One received transfer. Verify it, then answer exactly once with reply().

    Exactly one of: `payload` (a staged copy, not yet in any page), `landed` (the bytes are in the claimed
    pages; nothing more can land there) or `error` (the claimed pages' bytes did not all arrive). With an error,
    `still_landing` says that bytes may still land in the claimed pages (a read past its deadline): end the
    request, keep the pages, do not answer; the arrival that ends the landing follows."""

    def __init__(self, transfer_id: str, manifest: KVManifest, payload: PagePayload | None,
                 reply_fn: Callable[[bool, ErrorInfo | None], bool], *, landed: PoolPages | None = None,
                 error: ErrorInfo | None = None, still_landing: bool = False) -> None:
        if (payload is not None) + (landed is not None) + (error is not None) != 1:
            raise ValueError("an Arrival carries exactly one of payload, landed or error")
        if still_landing and error is None:
            raise ValueError("only an error arrival can say that bytes are still landing")
        self.transfer_id, self.manifest, self.payload = transfer_id, manifest, payload
        self.landed, self.error, self.still_landing = landed, error, still_landing
        self._reply_fn: Callable[[bool, ErrorInfo | None], bool] | None = reply_fn

    def reply(self, ok: bool, error: ErrorInfo | None = None) -> bool:
        """Ack (ok) or nack (with the error that ends the request). False if the sender is gone."""
        if self.still_landing:
            raise RuntimeError(f"transfer {self.transfer_id} is still landing: answer the arrival that ends it")
        if self._reply_fn is None:
            raise RuntimeError(f"transfer {self.transfer_id} was already answered")
        if ok == (error is not None):
            raise ValueError("reply(ok=True) takes no error; reply(ok=False) needs one")
        fn, self._reply_fn = self._reply_fn, None
        return fn(ok, error)

    @property
    def answered(self) -> bool:
        return self._reply_fn is None


class Transport(ABC):
    """A KV transport endpoint; one instance may send, receive, or both."""

    staged: bool = True  # sends a packed copy (PagePayload); False: moves PoolPages in place (see the top)

    def __init__(self) -> None:
        self._owner: int | None = None

    def _own(self) -> None:
        """Bind the instance to the first thread that uses it; refuse every other thread."""
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
        elif self._owner != me:
            raise RuntimeError(f"{type(self).__name__} is used from one thread only; create one per thread")

    def register(self, pool_k: torch.Tensor, pool_v: torch.Tensor) -> None:
        """Make the pool's memory known to the backend (RDMA registration). A no-op where nothing is pinned."""

    @abstractmethod
    def send(self, endpoint: str, manifest: KVManifest, payload: PagePayload | PoolPages, *,
             timeout_s: float | None = None, server_key: str | None = None,
             session: str | None = None) -> TransferHandle:
        """Start sending; never blocks on the peer. The payload (or the pages) must not be modified until the
        transfer is done (acked, refused, timed out) or aborted. With fleet keys: server_key is the receiver's
        key (its reservation's kv_key), pinned; session its reservation's kv_session (MAC framing), if any."""

    @abstractmethod
    def poll(self, handle: TransferHandle) -> TransferStatus:
        """Non-blocking. A terminal status is reported once; polling the handle again raises KeyError."""

    @abstractmethod
    def abort(self, handle: TransferHandle) -> None:
        """Forget the transfer: a late answer is dropped. The receiver's reservation is released by the
        control plane, not here. Aborting an unknown or finished handle does nothing."""

    @abstractmethod
    def listen(self, bind_endpoint: str) -> str:
        """Start receiving; returns the actual endpoint (a port of 0 is chosen by the OS)."""

    @abstractmethod
    def recv(self, timeout_s: float, claim: Claim | None = None) -> Arrival | None:
        """The next arrival, or None after timeout_s. An in-place transport needs `claim`."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets; pending transfers are dropped."""

    def tend(self) -> None:
        """Sender housekeeping, once per worker loop turn: take late answers that release what was offered."""

    def figures(self) -> dict[str, int]:
        """What the transport holds now, for /info and /metrics (an in-place transport: reads in flight or past
        their deadline, pages they keep, offered pages kept until the receiver answers)."""
        return {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# name -> "module:class". Read-only; modules are imported on lookup, so an optional backend's dependencies
# (NIXL, Mooncake) are needed only by the deployments that choose it.
TRANSPORTS: Mapping[str, str] = MappingProxyType({
    "zmq": "kvseal.transfer.zmq:ZmqTransport",
    "nixl": "kvseal.transfer.nixl:NixlTransport",
})


def transport_class(name: str) -> type[Transport]:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}: use one of {', '.join(sorted(TRANSPORTS))}")
    module, _, attr = TRANSPORTS[name].partition(":")
    cls = getattr(importlib.import_module(module), attr)
    assert isinstance(cls, type) and issubclass(cls, Transport)
    return cls


def create_transport(name: str, **options: Any) -> Transport:
    return transport_class(name)(**options)

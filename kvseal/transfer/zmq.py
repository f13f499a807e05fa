"""The default KV transport: ZeroMQ over TCP (one host or many).

Wire, per transfer: DEALER (sender, one per destination endpoint) -> ROUTER (receiver) multipart message
    [TransferHeader (msgpack: transfer id + KVManifest), K bytes, V bytes]
sent with copy=False, so libzmq reads straight from the payload's contiguous buffers; the payload must not be
modified after send(). The receiver answers on the same connection with one TransferReply (msgpack).
No pickles: a frame that does not decode into the expected struct is refused.
With fleet keys (`keys`) the channel is authenticated both ways, in one of two ways the receiver chooses (its
reservations say which, so the sender follows):
- "mac" (default for this transport): KV bytes in clear, an HMAC on every message both ways and a session token
  at the handshake (kvmac.py; the session travels in the reservation over the CURVE control channels): a frame
  without the tag is dropped unread, an unknown peer is refused at the handshake;
- "curve" (`encrypt`, and always for NIXL's offers): ZeroMQ CURVE; the receiver takes only allow-listed members,
  the sender pins the receiver's key (the reservation's `kv_key`).

Threading: one instance per thread (ZeroMQ sockets are not thread-safe); see base.Transport.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from kvseal.auth.curve import as_plain_server, as_server
from kvseal.auth.keys import MemberKeys
from kvseal.auth.zap import ZapHandler
from kvseal.errors import ErrorInfo, TransferTimeout, TransferVerificationFailed
from kvseal.transfer.base import Arrival, Claim, TransferHandle, TransferState, TransferStatus, Transport
from kvseal.transfer.kvmac import KvMac, new_session
from kvseal.transfer.manifest import SCHEMA_VERSION, KVManifest, PagePayload, PoolPages
from kvseal.transfer.zmq_dealers import Dealers, kv_socket
from kvseal.transfer.zmq_wire import (
    Frame,
    Mutate,
    Source,
    TransferHeader,
    TransferIdOnly,
    TransferReply,
    failed,
    reply_status,
)

log = logging.getLogger("kvseal.transfer")


@dataclass(frozen=True, slots=True)
class _Pending:
    handle: TransferHandle
    deadline: float  # time.monotonic()
    timeout_s: float


class ZmqTransport(Transport):
    """Sender and/or receiver over ZeroMQ/TCP.

    timeout_s: a sent transfer with no answer after this long is TIMED_OUT (per send() override possible).
    mutate: test-only fault injection, applied to (manifest, payload) just before they go on the wire.
    Subclasses that carry the bytes otherwise (nixl.py) keep this control channel and override
    `_outgoing` (what follows the header) and `_arrival` (what the receiver makes of it).
    hwm: messages (whole transfers) queued per peer and direction before send() reports FAILED.
    max_frame_bytes: the receiver drops peers that send a larger frame (bounds memory); None: no bound.
    keys: this member's fleet keys; None: plain ZeroMQ (loopback fleets without keys).
    encrypt: as a receiver with keys, CURVE instead of the MAC framing (see the top).
    """

    def __init__(self, *, timeout_s: float = 30.0, mutate: Mutate | None = None, hwm: int = 1000,
                 io_threads: int = 1, max_frame_bytes: int | None = None,
                 keepalive_idle_s: int = 30, keys: MemberKeys | None = None, encrypt: bool = False) -> None:
        super().__init__()
        if timeout_s <= 0 or hwm < 1 or io_threads < 1:
            raise ValueError(f"invalid ZmqTransport(timeout_s={timeout_s}, hwm={hwm}, io_threads={io_threads}):"
                             " give a positive timeout, hwm and io_threads")
        self.timeout_s, self._mutate, self._hwm = timeout_s, mutate, hwm
        self._max_frame = -1 if max_frame_bytes is None else max_frame_bytes
        self._keepalive_idle = keepalive_idle_s
        self._ctx = zmq.Context(io_threads=io_threads)
        self.keys, self.encrypt = keys, encrypt
        self._zap: ZapHandler | None = None  # started by listen() with keys
        self._mac: KvMac | None = None  # a receiver's MAC framing (keys, not encrypt)
        self.kv_session = ""  # ... and its session, for the reservations (the sender learns it there)
        self.frames_unauthenticated = 0  # messages dropped unread: no valid MAC
        self._dealers = Dealers(self._socket, keys)  # a sender's one DEALER per receiver endpoint
        self._pending: dict[str, _Pending] = {}  # transfer id -> in flight, no answer yet
        self._done: dict[str, TransferStatus] = {}  # transfer id -> terminal status not yet polled
        self._router: zmq.Socket[bytes] | None = None
        self._endpoint: str | None = None
        self._closed = False
        self._enc = msgspec.msgpack.Encoder()
        self._header_dec = msgspec.msgpack.Decoder(TransferHeader)
        self._id_dec = msgspec.msgpack.Decoder(TransferIdOnly)
        self._reply_dec = msgspec.msgpack.Decoder(TransferReply)

    # -- sockets ----------------------------------------------------------------------------------------
    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        if self._closed:
            raise RuntimeError("the transport is closed")
        return kv_socket(self._ctx, kind, self._hwm, self._keepalive_idle)

    @property
    def auth_refused(self) -> int:
        """Connections to this receiver refused before any frame was read (not on the fleet allow-list)."""
        return self._zap.refused if self._zap is not None else 0

    # -- sender -----------------------------------------------------------------------------------------
    def send(self, endpoint: str, manifest: KVManifest, payload: PagePayload | PoolPages, *,
             timeout_s: float | None = None, server_key: str | None = None,
             session: str | None = None) -> TransferHandle:
        self._own()
        handle = TransferHandle(secrets.token_hex(8), endpoint, manifest.request_id)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        manifest, frames = self._outgoing(handle, manifest, payload, timeout)
        self._post(handle, manifest, frames, timeout, server_key, session)
        return handle

    def _post(self, handle: TransferHandle, manifest: KVManifest, frames: list[Frame], timeout: float,
              server_key: str | None, session: str | None) -> None:
        """Put [header, *frames] on the wire to handle.endpoint: PENDING until answered, or FAILED at once."""
        endpoint = handle.endpoint
        header = self._enc.encode(TransferHeader(transfer_id=handle.transfer_id, manifest=manifest))
        try:
            sock = self._dealers.open(endpoint, server_key, session)
            mac = self._dealers.mac(endpoint)
            tag = [mac.tag([header, *frames])] if mac is not None else []
            # Whole multipart messages are queued atomically: NOBLOCK fails before any part goes, or not at all.
            sock.send_multipart([header, *frames, *tag], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # no pipe with room: the queue is full, or the handshake failed (the pipe is gone)
            self._done[handle.transfer_id] = failed(
                f"KV transfer of request {manifest.request_id!r} to {endpoint} could not be queued: either "
                f"{self._hwm} transfers wait unread (the decode worker is not reading) or the receiver failed "
                f"the handshake (it does not hold the key this worker pins)")
        except (zmq.ZMQError, PermissionError, ValueError) as e:  # ValueError: an unreadable allow-list
            self._done[handle.transfer_id] = failed(
                f"KV transfer of request {manifest.request_id!r} to {endpoint} could not be sent: {e}")
        else:
            self._pending[handle.transfer_id] = _Pending(handle, time.monotonic() + timeout, timeout)

    def _outgoing(self, handle: TransferHandle, manifest: KVManifest, payload: Source,
                  timeout_s: float) -> tuple[KVManifest, list[Frame]]:
        """The (possibly fault-mutated) manifest and the frames after the header: here K bytes, V bytes."""
        if isinstance(payload, PoolPages):
            payload = payload.pack()
        if self._mutate is not None:
            manifest, payload = self._mutate(manifest, payload)
        assert isinstance(payload, PagePayload)
        return manifest, [payload.k.numpy().data, payload.v.numpy().data]

    def _answered(self, endpoint: str, transfer_id: str) -> None:
        """The receiver at `endpoint` answered `transfer_id` (in time or late): it is done with what was offered."""

    def poll(self, handle: TransferHandle) -> TransferStatus:
        self._own()
        tid = handle.transfer_id
        self._drain(handle.endpoint)
        if tid in self._done:
            return self._done.pop(tid)
        pending = self._pending.get(tid)
        if pending is None:
            raise KeyError(f"unknown transfer {tid}: never sent, aborted, or its outcome was already polled")
        if time.monotonic() >= pending.deadline:
            del self._pending[tid]
            return TransferStatus(TransferState.TIMED_OUT, TransferTimeout(
                f"the decode worker at {handle.endpoint} did not acknowledge the KV of request "
                f"{handle.request_id!r} within {pending.timeout_s:g}s").to_info())
        return TransferStatus(TransferState.PENDING)

    def abort(self, handle: TransferHandle) -> None:
        self._own()
        self._pending.pop(handle.transfer_id, None)
        self._done.pop(handle.transfer_id, None)

    def _drain(self, endpoint: str) -> None:
        """Read every answer already waiting on `endpoint`'s DEALER; never blocks."""
        sock = self._dealers.get(endpoint)
        while sock is not None:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            mac = self._dealers.mac(endpoint)
            if mac is not None:  # an answer without the session's tag is not the receiver's: dropped unread
                frames = frames[:1] if len(frames) == 2 and mac.check(frames[:1], frames[1]) else []
            try:
                reply = self._reply_dec.decode(frames[0]) if len(frames) == 1 else None
            except msgspec.DecodeError:
                reply = None
            if reply is None:
                log.warning("dropping a malformed transfer reply from %s", endpoint)
                continue
            self._answered(endpoint, reply.transfer_id)
            pending = self._pending.pop(reply.transfer_id, None)
            if pending is None:
                continue  # aborted or timed out: a late answer changes nothing
            self._done[reply.transfer_id] = reply_status(endpoint, reply)

    # -- receiver ---------------------------------------------------------------------------------------
    def listen(self, bind_endpoint: str) -> str:
        self._own()
        if self._router is not None:
            raise RuntimeError(f"already listening on {self._endpoint}")
        addr = bind_endpoint
        if addr.startswith("tcp://") and addr.rsplit(":", 1)[1] in ("0", "*"):
            addr = addr.rsplit(":", 1)[0] + ":*"  # the OS picks a free port; no guess-and-retry
        if self.keys is not None and not self.encrypt and self._mac is None:
            self.kv_session = new_session()
            self._mac = KvMac(self.kv_session)
        if self.keys is not None and self._zap is None:  # before the bind: no unchecked handshake
            self._zap = ZapHandler(self._ctx, self.keys, "KV port", self._mac.token if self._mac else None)
        sock = self._socket(zmq.ROUTER)
        if self._mac is not None:
            as_plain_server(sock)
        else:
            as_server(sock, self.keys)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an answer to a vanished sender fails instead of vanishing
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        try:
            sock.bind(addr)
        except zmq.ZMQError as e:
            sock.close(0)
            raise OSError(f"cannot listen for KV transfers on {bind_endpoint}: {e}") from e
        self._router = sock
        self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self._endpoint

    def recv(self, timeout_s: float, claim: Claim | None = None) -> Arrival | None:
        self._own()
        if self._router is None:
            raise RuntimeError("recv() before listen()")
        deadline = time.monotonic() + timeout_s
        while True:
            done = self._progress()
            if done is not None:
                return done
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if self._busy():
                wait_ms = min(wait_ms, 1)  # bytes in flight elsewhere: look again soon
            if not self._router.poll(wait_ms, zmq.POLLIN):
                if time.monotonic() >= deadline:
                    return None
                continue
            frames = self._router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            arrival = self._parse(frames, claim)
            if arrival is not None:
                return arrival

    def _progress(self) -> Arrival | None:
        """An arrival that finished landing outside this socket (an in-place subclass), else None."""
        return None

    def _busy(self) -> bool:
        """Whether bytes are landing outside this socket (an in-place subclass)."""
        return False

    def _parse(self, frames: list[zmq.Frame], claim: Claim | None) -> Arrival | None:
        peer, parts = frames[0].bytes, frames[1:]
        if self._mac is not None:  # nothing of a message is read before its tag checks out
            if len(parts) < 2 or not self._mac.check([p.buffer for p in parts[:-1]], parts[-1].buffer):
                self.frames_unauthenticated += 1
                log.warning("dropping a KV message without a valid MAC (%d so far)", self.frames_unauthenticated)
                return None
            parts = parts[:-1]
        try:
            header = self._header_dec.decode(parts[0].buffer)
        except (msgspec.DecodeError, IndexError) as e:
            self._refuse(peer, parts, f"malformed transfer header: {e}")
            return None
        if header.v != SCHEMA_VERSION or len(parts) != self._num_frames:
            self._refuse(peer, parts, f"transfer of {len(parts)} frames with schema v{header.v}; expected "
                         f"{self._num_frames} frames with schema v{SCHEMA_VERSION}: run one kvseal version "
                         f"and one --kv-transport on all workers")
            return None
        tid = header.transfer_id
        return self._arrival(tid, header.manifest, parts[1:], lambda ok, err: self._reply(peer, tid, ok, err),
                             claim)

    _num_frames = 3  # header, K bytes, V bytes

    def _arrival(self, transfer_id: str, manifest: KVManifest, frames: list[zmq.Frame],
                 reply: Callable[[bool, ErrorInfo | None], bool], claim: Claim | None) -> Arrival | None:
        payload = PagePayload.from_buffers(frames[0].buffer, frames[1].buffer, manifest.num_pages)
        return Arrival(transfer_id, manifest, payload, reply)

    def _refuse(self, peer: bytes, parts: list[zmq.Frame], why: str) -> None:
        try:
            tid = self._id_dec.decode(parts[0].buffer).transfer_id
        except (msgspec.DecodeError, IndexError):
            log.warning("dropping an unreadable KV transfer: %s", why)
            return
        log.warning("refusing KV transfer %s: %s", tid, why)
        self._reply(peer, tid, False, TransferVerificationFailed(why).to_info())

    def _reply(self, peer: bytes, transfer_id: str, ok: bool, error: ErrorInfo | None) -> bool:
        self._own()
        if self._router is None:
            return False
        msg = self._enc.encode(TransferReply(transfer_id=transfer_id, ok=ok, error=error))
        tag = [self._mac.tag([msg])] if self._mac is not None else []
        try:
            self._router.send_multipart([peer, msg, *tag], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH (sender gone) or EAGAIN (sender not reading)
            log.warning("could not answer KV transfer %s: %s", transfer_id, e)
            return False
        return True

    # -- lifetime ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Close every socket (LINGER 0: queued, unsent transfers are dropped). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._dealers.close()
        if self._router is not None:
            self._router.close(0)
        self._router = None
        self._pending.clear()
        if self._zap is not None:
            self._zap.stop()
        self._ctx.term()


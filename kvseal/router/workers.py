"""The router's handle on one worker: a ZeroMQ DEALER, calls with timeouts, each request's frames handed to the
request (router/disagg_request.py), and the worker's standing in the fleet (router/membership.py).

A worker gets requests only while SERVING, and it gets there only by passing the fleet check (seal 7) that the
backend hands in as `check`: when it is first admitted, and again whenever it connects, reconnects or answers as
a new process (another instance id). A dropped connection, or no answer to the heartbeat, fails its requests at
once.

With fleet keys the DEALER is a CURVE client pinned to the worker's own key (`server_key`): a process at that
endpoint without the worker's secret key completes no handshake, so it never gets a frame from the router.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from kvseal.auth.curve import as_client
from kvseal.auth.keys import MemberKeys
from kvseal.errors import CapacityMismatch, ErrorInfo, WorkerFailed
from kvseal.router.membership import Membership, Standing
from kvseal.wire import protocol as P
from kvseal.wire.card import WorkerCard
from kvseal.wire.roles import Role

log = logging.getLogger("kvseal.router")

# raises CapacityMismatch when the worker (its fresh card) may not serve in this fleet
Check = Callable[["WorkerClient", WorkerCard], None]


class Routed(Protocol):
    """A request as a worker connection's reader sees it (router/disagg_request.py `DisaggRequest`): each frame
    for the request is handed to the request itself, which checks that it comes from its own worker."""

    def handoff_started(self, w: WorkerClient) -> None: ...

    def take_delta(self, w: WorkerClient, msg: P.DeltaMsg) -> None: ...

    def worker_lost(self, w: WorkerClient, err: ErrorInfo) -> None: ...


class WorkerClient:
    def __init__(self, role: Role, endpoint: str, ctx: zmq.asyncio.Context, check: Check,
                 heartbeat_s: float = 1.0, dead_after_s: float = 60.0, registered: bool = False,
                 keys: MemberKeys | None = None, server_key: str | None = None,
                 requests: Mapping[str, Routed] | None = None) -> None:
        self.role, self.endpoint, self.check = role, endpoint, check
        self.registered = registered  # joined through the fleet socket (not on the router's command line)
        self.server_key = server_key  # the worker's fleet key, pinned (None without keys)
        self.keys = keys
        self.sock: zmq.asyncio.Socket = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        as_client(self.sock, keys, server_key, f"{role} worker at {endpoint}")
        self.sock.connect(endpoint)
        self.heartbeat_s, self.dead_after_s = heartbeat_s, dead_after_s
        self.member = Membership(self.name)
        self.instance: str | None = None  # the worker process that last passed (or failed) the check
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[P.Message]] = {}
        # the router's one home for its requests (DisaggBackend.requests, read here): this connection's reader
        # hands a request's frames (its deltas, its handoff notice) to the request
        self.requests: Mapping[str, Routed] = {} if requests is None else requests
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()  # a (re)connect: run the heartbeat (and so the join check) now
        self._join_lock = asyncio.Lock()
        self.last_seen = time.monotonic()
        self.last: P.InfoResp | None = None  # its last answer to an info request (None: it never answered)
        self.tenant_inflight: Counter[str] = Counter()  # requests routed here and not yet ended, per tenant

    @property
    def name(self) -> str:
        return f"{self.role} worker {self.endpoint}"

    @property
    def card(self) -> WorkerCard:
        """The card of a worker in rotation: the one it passed the fleet check with (a new process is checked
        again before it gets a request, so the last card it sent is that one)."""
        assert self.last is not None, f"{self.name} never answered an info request"
        return self.last.card

    @property
    def inflight(self) -> int:
        """Requests routed here and not yet ended: the load used for pairing."""
        return sum(self.tenant_inflight.values())

    @property
    def fairness(self) -> str:
        """How the worker shares itself among tenants (--fairness): "vtc" or "off"."""
        return self.card.fairness

    def routed(self, tenant: str, n: int = 1) -> None:
        """A request of `tenant` was routed here (n=1) or ended (n=-1)."""
        self.tenant_inflight[tenant] += n
        if self.tenant_inflight[tenant] <= 0:
            del self.tenant_inflight[tenant]

    def info_json(self) -> dict[str, Any]:
        """Its /info as of its last answer ({} before the first)."""
        return {} if self.last is None else self.last.to_json()

    @property
    def alive(self) -> bool:
        """In rotation: it gets new requests."""
        return self.member.serving

    def open(self) -> None:
        """Start reading answers (before the router's start-up check)."""
        self._tasks.append(asyncio.ensure_future(self._reader()))

    def watch(self) -> None:
        """Start the heartbeat and the connection monitor: from here on every (re)join is checked."""
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._tasks += [asyncio.ensure_future(self._heartbeat()), asyncio.ensure_future(self._watch())]

    def admitted(self, card: WorkerCard) -> None:
        """The router's start-up check passed this worker (with the whole fleet)."""
        self.instance = card.instance
        self.member.move(Standing.CHECKING)
        self.member.move(Standing.SERVING)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if len(self._tasks) > 1:
            self.sock.disable_monitor()
            self._monitor.close(0)
        self.sock.close(0)

    # -- joining ---------------------------------------------------------------------------------------
    async def join(self) -> None:
        """Check the worker in full against the fleet; SERVING if it passes, REFUSED (with the reason) if not."""
        async with self._join_lock:
            self.member.move(Standing.CHECKING)
            try:
                resp = await self.fetch_info(timeout=10.0)
            except WorkerFailed as err:
                self._lose(err.message)
                return
            except CapacityMismatch as err:  # its answer does not decode (a card missing a field): another version
                self.member.move(Standing.REFUSED, err.message)
                return
            self.instance = resp.card.instance
            try:
                self.check(self, resp.card)
            except CapacityMismatch as err:
                self.member.move(Standing.REFUSED, err.message)
            else:
                if self.revoked():
                    self.member.move(Standing.REFUSED, f"its fleet key {self.server_key} is no longer on the "
                                                       f"router's allow-list (revoked)")
                    return
                self.member.move(Standing.SERVING)
                if resp.draining:
                    self.member.move(Standing.DRAINING, "it reports that it is draining")

    async def _watch(self) -> None:
        """A dropped TCP connection means the worker process died (or its host went away): fail its requests at
        once instead of waiting for the heartbeat. A new connection wakes the heartbeat, which checks it."""
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._lose(f"{self.name} disconnected (the worker died, left, or its host is gone)")
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._wake.set()

    async def _heartbeat(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.heartbeat_s)
            except TimeoutError:
                pass
            self._wake.clear()
            try:  # a worker that is not connected answers quickly once it is back, or not at all
                resp = await self.fetch_info(timeout=self.dead_after_s if self.member.connected else 2.0)
            except WorkerFailed:
                self._lose(f"{self.name} stopped answering (dead or unreachable)")
                continue
            except CapacityMismatch:  # an answer it cannot read: refused (once) with the reason, by join()
                if self.member.standing is not Standing.REFUSED:
                    await self.join()
                continue
            st = self.member.standing
            if resp.card.instance != self.instance or st in (Standing.LOST, Standing.LEFT, Standing.CONNECTING):
                await self.join()  # a new process on this endpoint, or one coming back: checked before use
            elif st is Standing.SERVING and resp.draining:
                self.member.move(Standing.DRAINING, "it reports that it is draining")
            elif st is Standing.SERVING and self.revoked():
                await self.join()  # out of rotation within a heartbeat of its key file's deletion

    def revoked(self) -> bool:
        """With fleet keys: the worker's key left the router's allow-list (an unreadable one counts as left)."""
        if self.keys is None or self.server_key is None:
            return False
        try:
            return not self.keys.admits(self.server_key)
        except ValueError:
            return True

    def _lose(self, why: str) -> None:
        st = self.member.standing
        if st is Standing.DRAINING:
            self.member.move(Standing.LEFT)
        elif st in (Standing.CONNECTING, Standing.CHECKING, Standing.SERVING):
            self.member.move(Standing.LOST, why)
        # a REFUSED worker that goes away stays REFUSED with its reason: out of rotation, and /info says why
        self._fail_all(WorkerFailed(why))

    # -- calls and streams ------------------------------------------------------------------------------
    async def call(self, make: Any, timeout: float | None) -> P.Message:
        """Send make(call_id) and await the answer with the same call_id. timeout None: as long as the worker
        is connected (a lost worker fails every call at once)."""
        cid = next(self._ids)
        fut: asyncio.Future[P.Message] = asyncio.get_running_loop().create_future()
        self._calls[cid] = fut
        try:
            await self.notify(make(cid))
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise WorkerFailed(f"{self.name} did not answer within {timeout:g}s") from None
        finally:
            self._calls.pop(cid, None)

    async def notify(self, msg: P.Message) -> None:
        """Send msg (every frame to this worker leaves here; a call then awaits its answer)."""
        await self.sock.send(P.encode(msg))

    async def fetch_info(self, timeout: float = 5.0) -> P.InfoResp:
        resp = await self.call(lambda cid: P.InfoReq(call_id=cid), timeout)
        if not isinstance(resp, P.InfoResp):
            raise WorkerFailed(f"{self.name} answered {type(resp).__name__} to an info request")
        self.last = resp
        return resp

    async def _reader(self) -> None:
        while True:
            data = await self.sock.recv()
            self.last_seen = time.monotonic()
            try:
                msg = P.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("%s sent a malformed message: %s", self.name, exc)
                fut = self._calls.get(P.call_id_of(data) or 0)
                if fut is not None and not fut.done():
                    fut.set_exception(CapacityMismatch(
                        f"{self.name} answered with a message this router cannot read ({exc}): it runs another "
                        f"kvseal version. Fix: run one kvseal version on the router and every worker."))
                continue
            match msg:
                case P.HandoffStarted(request_id=rid):
                    if (r := self.requests.get(rid)) is not None:
                        r.handoff_started(self)
                case P.DeltaMsg():
                    if (r := self.requests.get(msg.delta.request_id)) is not None:
                        r.take_delta(self, msg)  # else it already ended (client gone, failed): dropped
                case P.DrainNotice():
                    if self.member.standing is Standing.SERVING:
                        self.member.move(Standing.DRAINING, "it is draining (SIGTERM or `kvseal drain`)")
                case _:
                    fut = self._calls.get(getattr(msg, "call_id", -1))
                    if fut is not None and not fut.done():
                        fut.set_result(msg)

    def _fail_all(self, err: WorkerFailed) -> None:
        info = err.to_info()
        for r in list(self.requests.values()):
            r.worker_lost(self, info)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(WorkerFailed(err.message))

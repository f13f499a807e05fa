"""What the ZeroMQ KV transport puts on the wire (transfer/zmq.py): the header before a transfer's frames and the
receiver's one reply. msgpack of these structs only: a frame that does not decode into them is refused."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from kvseal.errors import ErrorInfo, WorkerFailed
from kvseal.transfer.base import TransferState, TransferStatus
from kvseal.transfer.manifest import SCHEMA_VERSION, KVManifest, PagePayload, PoolPages

Source = PagePayload | PoolPages
Mutate = Callable[[KVManifest, Source], tuple[KVManifest, Source]]  # test-only fault injection before the wire
Frame = bytes | memoryview


class TransferHeader(msgspec.Struct, frozen=True, kw_only=True):
    transfer_id: str
    manifest: KVManifest
    v: int = SCHEMA_VERSION


class TransferReply(msgspec.Struct, frozen=True, kw_only=True):
    transfer_id: str
    ok: bool
    error: ErrorInfo | None = None  # set when ok is False: the receiver's original error
    v: int = SCHEMA_VERSION


class TransferIdOnly(msgspec.Struct):  # salvages the id of a malformed header, to nack it
    transfer_id: str


def failed(message: str) -> TransferStatus:
    return TransferStatus(TransferState.FAILED, WorkerFailed(message).to_info())


def reply_status(endpoint: str, reply: TransferReply) -> TransferStatus:
    """What the receiver at `endpoint` answered a transfer, as its terminal status."""
    if reply.v != SCHEMA_VERSION:
        return failed(f"the decode worker at {endpoint} answers with transfer schema v{reply.v}, this worker speaks "
                      f"v{SCHEMA_VERSION}: run one kvseal version")
    if reply.ok:
        return TransferStatus(TransferState.ACKED)
    return TransferStatus(TransferState.REJECTED, reply.error or WorkerFailed(
        f"the decode worker at {endpoint} refused the KV without saying why").to_info())

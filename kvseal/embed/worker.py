"""The embed worker: a process with the embedding model behind a ZeroMQ control socket, one thread, one loop.

Each turn: read every pending message (calls join their tenant's queue, aborts drop what is still queued, a hello
is answered with the card), then run one batch from the fair queue (embed/queue.py) and answer each call whose
last input it embedded. A message waits at most one batch. It holds no KV and no prefix cache: a call's token ids
and its output rows are its own, dropped when it is answered or aborted.

`kvseal serve --embed-model` starts it (`python -m kvseal.embed.worker`, its EmbedSpec as JSON on stdin). With
fleet keys its socket is a CURVE server that takes only the router's key. No frame from a peer ends the process.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import msgspec
import zmq

from kvseal.auth.curve import as_server, check_bind
from kvseal.auth.zap import ZapHandler
from kvseal.embed import wire
from kvseal.embed.checkpoint import EmbedModel
from kvseal.embed.queue import Call, FairQueue, Piece
from kvseal.embed.spec import EmbedSpec
from kvseal.errors import InternalError, InvalidRequest, KvsealError
from kvseal.wire.protocol import LAUNCHER_PID_ENV
from kvseal.worker.outbox import Outbox

log = logging.getLogger("kvseal.embed")


class EmbedWorker:
    def __init__(self, spec: EmbedSpec) -> None:
        check_bind(spec.host, spec.keys, "embed worker's control port", "--host")
        self.model = EmbedModel(spec.model)
        self.budget = spec.batch_tokens
        self.ctx = zmq.Context()
        self.zap = ZapHandler(self.ctx, spec.keys, "embed port") if spec.keys is not None else None
        self.sock: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        as_server(self.sock, spec.keys)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(f"tcp://{spec.host}:{spec.port}")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.outbox = Outbox(self.sock)
        self.queue = FairQueue()
        self.calls: dict[tuple[bytes, int], Call] = {}  # every call not yet answered (queued or in the batch)
        self._stop = False
        launcher = os.environ.get(LAUNCHER_PID_ENV)
        self._parent = int(launcher) if launcher else None

    def send(self, peer: bytes, msg: wire.Message) -> None:
        self.outbox.send(peer, wire.encode(msg))

    def card(self, call_id: int) -> wire.Card:
        m = self.model
        return wire.Card(call_id=call_id, model=m.name, dim=m.dim, max_tokens=m.pipeline.max_tokens,
                         pooling=m.pipeline.pooling, normalize=m.pipeline.normalize, queued_inputs=self.queue.inputs)

    def take(self, peer: bytes, data: bytes) -> None:
        try:
            msg = wire.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("dropped a frame that does not decode: %s", exc)
            return
        if isinstance(msg, wire.Hello):
            self.send(peer, self.card(msg.call_id))
        elif isinstance(msg, wire.EmbedReq):
            self.admit(peer, msg)
        elif isinstance(msg, wire.Abort):
            self.queue.abort((peer, msg.call_id))
            self.calls.pop((peer, msg.call_id), None)
        else:
            log.warning("dropped a %s: not a message for the embed worker", type(msg).__name__)

    def admit(self, peer: bytes, msg: wire.EmbedReq) -> None:
        """A call joins its tenant's queue, or is refused at once (the router checked it; a peer may not)."""
        limit, vocab = self.model.pipeline.max_tokens, self.model.arch.vocab_size
        bad = next((i for i, x in enumerate(msg.ids) if not 1 <= len(x) <= limit or not all(
            0 <= t < vocab for t in x)), None)
        if not msg.ids or bad is not None or not msg.weight > 0:
            err = InvalidRequest(f"input {bad}: 1 to {limit} token ids under {vocab} each" if bad is not None else
                                 "an embed call needs inputs and a positive weight", param="input")
            self.send(peer, wire.EmbedResp(call_id=msg.call_id, error=err.to_info()))
            return
        call = Call(peer, msg.call_id, msg.tenant, msg.weight, msg.ids)
        self.calls[call.key] = call
        self.queue.put(call)

    def step(self, pieces: list[Piece]) -> None:
        """Embed one batch; answer each live call whose last input it held."""
        ids = [x for p in pieces for x in p.call.ids[p.start:p.stop]]
        try:
            rows = self.model.embed(ids)
        except Exception as exc:  # a failure fails the calls of this batch, not the process
            log.exception("a batch of %d inputs failed", len(ids))
            err = InternalError(f"the embed worker failed on this batch: {type(exc).__name__}").to_info()
            for p in pieces:
                if self.calls.pop(p.call.key, None) is not None:
                    self.queue.abort(p.call.key)
                    self.send(p.call.peer, wire.EmbedResp(call_id=p.call.call_id, error=err))
            return
        at = 0
        for p in pieces:
            n = p.stop - p.start
            p.call.rows.append(rows[at:at + n].astype("<f4").tobytes())
            p.call.done += n
            at += n
            if p.call.done == len(p.call.ids) and self.calls.pop(p.call.key, None) is not None:
                self.send(p.call.peer, wire.EmbedResp(call_id=p.call.call_id, data=b"".join(p.call.rows)))

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        log.info("embed worker ready on %s: %s (%d dimensions, %s pooling%s, at most %d tokens an input)",
                 self.endpoint, self.model.name, self.model.dim, self.model.pipeline.pooling,
                 ", normalized" if self.model.pipeline.normalize else "", self.model.pipeline.max_tokens)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while not self._stop:
                if self._parent is not None and os.getppid() != self._parent:
                    log.error("the kvseal serve that started this worker is gone; exiting")
                    return 1
                timeout = 0 if self.queue.waiting else 200
                if poller.poll(timeout):
                    while self.sock.poll(0):
                        peer, data = self.sock.recv_multipart()
                        self.take(peer, data)
                for peer in self.outbox.flush():  # a router gone: its calls end here
                    for key in [k for k in self.calls if k[0] == peer]:
                        self.queue.abort(key)
                        del self.calls[key]
                if self.queue.waiting:
                    self.step(self.queue.take(self.budget))
            return 0
        finally:
            self.sock.close(0)
            if self.zap is not None:
                self.zap.stop()
            self.ctx.term()

    def stop(self, *_: object) -> None:
        self._stop = True


def main() -> int:
    """`python -m kvseal.embed.worker` with an EmbedSpec as JSON on stdin (what `kvseal serve` starts)."""
    try:
        spec = msgspec.json.decode(sys.stdin.buffer.read(), type=EmbedSpec)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        print(f"kvseal embed worker: refusing its start message: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=spec.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if spec.threads is not None:
        import torch

        torch.set_num_threads(max(1, spec.threads))
    try:
        worker = EmbedWorker(spec)
    except (ValueError, KvsealError) as exc:
        print(f"kvseal: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    code = worker.run()
    log.info("embed worker stopped after %.0f s", time.monotonic() - started)
    return code


if __name__ == "__main__":
    sys.exit(main())

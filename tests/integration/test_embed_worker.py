"""The embed worker process (`python -m kvseal.embed.worker`, as `kvseal serve --embed-model` starts it) over real
sockets on 127.0.0.1, with fleet keys: the router's key gets the card and embeddings equal to the model's in
process; a stranger's key is refused at the handshake; a call a peer should never have sent (token
ids outside the vocabulary, an input over the model's length) is refused with a 400, and the worker goes on; and a
worker that dies fails the calls it held (502) and new ones (503) at once."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvseal.auth.curve import as_client
from kvseal.auth.keys import MemberKeys, fresh_member
from kvseal.embed import wire
from kvseal.embed.checkpoint import EmbedModel
from kvseal.embed.client import EmbedClient
from kvseal.embed.folder import EmbedFolder
from kvseal.embed.spec import EmbedSpec
from kvseal.errors import NoWorkerAvailable, WorkerFailed
from kvseal.wire.protocol import LAUNCHER_PID_ENV
from tests.helpers.procs import free_port
from tests.helpers.real_models import real_model

pytestmark = pytest.mark.integration


@dataclass
class Running:
    endpoint: str
    router: MemberKeys
    worker_key: str


def start() -> tuple[subprocess.Popen[bytes], Running]:
    router = fresh_member()
    member = fresh_member().with_allowed((router.public,))
    port = free_port()
    spec = EmbedSpec(model=real_model("all-minilm-l6-v2"), port=port, threads=1, batch_tokens=1024, keys=member)
    proc = subprocess.Popen([sys.executable, "-m", "kvseal.embed.worker"], stdin=subprocess.PIPE,
                            env={**os.environ, LAUNCHER_PID_ENV: str(os.getpid())})
    assert proc.stdin is not None
    proc.stdin.write(msgspec.json.encode(spec))
    proc.stdin.close()
    return proc, Running(f"tcp://127.0.0.1:{port}", router, member.public)


@pytest.fixture(scope="module")
def worker() -> Iterator[Running]:
    proc, running = start()
    try:
        yield running
    finally:
        proc.terminate()
        proc.wait(20)


def call(w: Running, msg: Any, keys: MemberKeys | None = None, timeout_s: float = 120.0) -> wire.Message | None:
    """Send one message as `keys` (default: the router's), pinned to the worker's key; its answer, or None."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        as_client(sock, keys or w.router, w.worker_key, "embed worker")
        sock.connect(w.endpoint)
        sock.send(wire.encode(msg))
        return wire.decode(sock.recv()) if sock.poll(int(timeout_s * 1000)) else None
    finally:
        sock.close(0)
        ctx.term()


def test_the_routers_key_gets_the_card_and_the_models_embeddings(worker: Running) -> None:
    card = call(worker, wire.Hello(call_id=1))  # the worker may still be loading: the first answer waits for it
    assert isinstance(card, wire.Card)
    assert (card.model, card.dim, card.max_tokens, card.pooling, card.normalize) == (
        "all-MiniLM-L6-v2", 384, 256, "mean", True)
    model = EmbedModel(real_model("all-minilm-l6-v2"))
    ids = [list(e.ids) for e in model.tokenizer.encode_batch(["a first text", "and a second, longer text"])]
    resp = call(worker, wire.EmbedReq(call_id=2, tenant="t", weight=1.0, ids=ids))
    assert isinstance(resp, wire.EmbedResp) and resp.error is None and resp.call_id == 2
    got = np.frombuffer(resp.data, dtype="<f4").reshape(2, 384)
    assert got == pytest.approx(model.embed(ids), abs=1e-6)


def test_a_strangers_key_is_refused_at_the_handshake(worker: Running) -> None:
    assert isinstance(call(worker, wire.Hello(call_id=1)), wire.Card)  # up and answering the router
    ctx = zmq.Context()
    try:
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        monitor = stranger.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        as_client(stranger, fresh_member(), worker.worker_key, "embed worker")  # pins the real key, not allowed
        stranger.connect(worker.endpoint)
        stranger.send(wire.encode(wire.Hello(call_id=2)))
        assert monitor.poll(60_000), "no handshake outcome"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        assert stranger.poll(0) == 0  # and nothing answered
        stranger.disable_monitor()
        monitor.close(0)
    finally:
        ctx.destroy(linger=0)


def test_a_call_the_router_would_never_send_is_refused_and_the_worker_goes_on(worker: Running) -> None:
    for ids in ([[101, 30522, 102]], [[101] * 257], [[]]):
        resp = call(worker, wire.EmbedReq(call_id=3, tenant="t", weight=1.0, ids=ids))
        assert isinstance(resp, wire.EmbedResp) and resp.error is not None and resp.error.status == 400, ids
    resp = call(worker, wire.EmbedReq(call_id=4, tenant="t", weight=0.0, ids=[[101, 102]]))
    assert isinstance(resp, wire.EmbedResp) and resp.error is not None and resp.error.status == 400
    ok = call(worker, wire.EmbedReq(call_id=5, tenant="t", weight=1.0, ids=[[101, 102]]))
    assert isinstance(ok, wire.EmbedResp) and ok.error is None and len(ok.data) == 384 * 4


def test_a_worker_that_dies_fails_the_calls_it_held_and_refuses_new_ones() -> None:
    """The router's client (as `kvseal serve` wires it) sees the process end: the call in flight fails with a 502
    at the next heartbeat, a new call is a 503; neither waits for the silence timeout."""
    proc, w = start()
    folder = EmbedFolder(real_model("all-minilm-l6-v2"))
    client = EmbedClient(w.endpoint, folder, keys=w.router, server_key=w.worker_key, dead_after_s=600.0)
    client.gone = lambda: proc.poll() is not None

    async def scenario() -> tuple[BaseException | None, BaseException | None]:
        await client.start()
        try:
            ids = [[101] + [2000 + i % 500 for i in range(250)] + [102]] * 2000  # minutes of work on one thread
            call = asyncio.ensure_future(client.embed("t", 1.0, ids))
            await asyncio.sleep(0.5)
            proc.kill()
            first = await asyncio.wait_for(asyncio.gather(call, return_exceptions=True), 60)
            second = await asyncio.gather(client.embed("t", 1.0, [[101, 102]]), return_exceptions=True)
            return first[0], second[0]
        finally:
            await client.stop()

    try:
        held, new = asyncio.run(scenario())
    finally:
        proc.kill()
        proc.wait(20)
    assert isinstance(held, WorkerFailed) and held.status == 502, held
    assert isinstance(new, NoWorkerAvailable) and new.status == 503, new

"""Peers of a real decode worker's KV port, for the transport tests: the decode worker itself (the tiny model,
in this process, pumped by the test), a prefill sender in a process of its own (so a test can stop it with
SIGSTOP while decode reads from it), and a reader that speaks NIXL directly with what an offer gave it."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from kvseal.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvseal.engine.engine import Engine
from kvseal.hooks import NO_FAULTS
from kvseal.transfer.base import TransferHandle, TransferStatus, Transport, create_transport
from kvseal.transfer.manifest import KVManifest, PoolPages, build_manifest
from kvseal.wire.kvspec import KVSpec
from kvseal.wire.messages import GenerateDelta, GenerateRequest, SamplingParams
from kvseal.wire.reservation import Reservation
from kvseal.worker.decode import DecodeWorker
from tests.unit.conftest import tiny_checkpoint

FIRST_TOKEN = 5


@dataclass(frozen=True)
class PoolSpec:
    """What a sender needs to build pages and manifests that fit a decode worker's pool."""

    shape: tuple[int, ...]
    dtype: str
    fingerprint: str
    page_size: int
    kv_layout: str

    @staticmethod
    def of(engine: Engine) -> PoolSpec:
        return PoolSpec(tuple(engine.pool.k.shape), str(engine.pool.k.dtype).removeprefix("torch."),
                        engine.fingerprint, engine.pool.page_size, engine.kv_layout)

    def pool(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        dtype = getattr(torch, self.dtype)
        return (torch.rand(self.shape, generator=g).add_(0.5).to(dtype),
                torch.rand(self.shape, generator=g).add_(0.5).to(dtype))  # no zero element: a landed byte shows

    def manifest(self, res: Reservation, pages: PoolPages) -> KVManifest:
        return build_manifest(res, pages, num_tokens=res.num_tokens, first_token=FIRST_TOKEN,
                              kv=KVSpec(model_fingerprint=self.fingerprint, page_size=self.page_size,
                              kv_dtype=self.dtype, kv_layout=self.kv_layout))


@contextmanager
def decode_worker(kv_transport: str, pool_tokens: int = 64) -> Iterator[DecodeWorker]:
    cfg = EngineConfig(model=ModelConfig(max_model_len=pool_tokens),
                       cache=CacheConfig(page_size=4, pool_tokens=pool_tokens),
                       scheduler=SchedulerConfig(max_num_batched_tokens=32))
    w = DecodeWorker(Engine(cfg, tiny_checkpoint(), role="decode"), "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", NO_FAULTS,
                     kv_transport=kv_transport)
    try:
        yield w
    finally:
        w.close()


def reserve(w: DecodeWorker, rid: str, prompt: int = 9) -> Reservation:
    req = GenerateRequest(rid, [7] * prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    return w.kv.reserve(req, 60.0, w.kv_endpoint)


def pump(w: DecodeWorker, until: Callable[[], bool], timeout: float = 30.0,
         finals: dict[str, GenerateDelta] | None = None) -> None:
    """Turn the decode worker's loop (KV in, one engine step) until `until()`; final deltas go into `finals`."""
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s; decode info: {w.info()}")
        w.pump()
        for d in w.engine.step() if w.engine.has_work() else []:
            if d.final is not None and finals is not None:
                finals[d.request_id] = d
        time.sleep(0.001)


def wait_status(tx: Transport, h: TransferHandle, also: Callable[[], None] = lambda: None,
                timeout: float = 30.0) -> TransferStatus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        also()
        st = tx.poll(h)
        if st.done:
            return st
        time.sleep(0.001)
    raise AssertionError("no terminal status")


# -- a prefill sender in its own process --------------------------------------------------------------------------
def _prefill(spec: PoolSpec, seed: int, cmds: mp.Queue[Any], out: mp.Queue[Any]) -> None:
    k, v = spec.pool(seed)
    tx = create_transport("nixl", timeout_s=30.0)
    tx.register(k, v)
    out.put(("ready", os.getpid()))
    handles: dict[str, TransferHandle] = {}
    while True:
        try:
            cmd = cmds.get(timeout=0.005)
        except queue.Empty:
            cmd = None
        if cmd == "stop":
            break
        if cmd == "figures":
            out.put(("figures", getattr(tx, "figures", dict)()))
        elif cmd is not None:
            res = msgspec.msgpack.decode(cmd[0], type=Reservation)
            src = PoolPages(k, v, tuple(cmd[1]))
            handles[res.request_id] = tx.send(res.kv_endpoint, spec.manifest(res, src), src, timeout_s=cmd[2])
        getattr(tx, "tend", lambda: None)()  # late answers (an older kvseal has no such step)
        for rid, h in list(handles.items()):
            st = tx.poll(h)
            if st.done:
                out.put(("status", rid, st.state.value))
                del handles[rid]
    tx.close()


class PrefillProcess:
    """`send(reservation, source pages, timeout_s)` runs NixlTransport.send in the child; its pool is
    `spec.pool(seed)`."""

    def __init__(self, spec: PoolSpec, seed: int = 1) -> None:
        ctx = mp.get_context("spawn")
        self.cmds: mp.Queue[Any] = ctx.Queue()
        self.out: mp.Queue[Any] = ctx.Queue()
        self.proc = ctx.Process(target=_prefill, args=(spec, seed, self.cmds, self.out), daemon=True)
        self.proc.start()
        kind, self.pid = self.out.get(timeout=120)
        assert kind == "ready"
        self.k, self.v = spec.pool(seed)  # the same bytes as the child's pool

    def send(self, res: Reservation, pages: list[int], timeout_s: float = 30.0) -> None:
        self.cmds.put((msgspec.msgpack.encode(res), pages, timeout_s))

    def figures(self) -> dict[str, int]:
        self.cmds.put("figures")
        while True:
            msg = self.out.get(timeout=30)
            if msg[0] == "figures":
                return dict(msg[1])

    def close(self) -> None:
        self.cmds.put("stop")
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()

"""KV transfer bandwidth: both KV transports against a raw loopback TCP copy of the same bytes.

    python -m benchmarks.transfer_bw                                   # 1k-32k tokens, pages of 16 and 64
    python -m benchmarks.transfer_bw --tokens 4096 --page-sizes 16 --repeats 5 --modes raw,zmq,nixl

The receivers (decode side) run in their own processes, the sender (prefill side) in this one; every time is
taken on the sender, from its first step to the receiver's answer, and reported as a median. The modes take
turns round by round (all receivers up at once), so the ratios hold on a machine whose load changes. `--pages scattered`
(default) takes each transfer's pages in random order on both sides, as a long-running allocator may hand them
out; `--pages runs` takes them in order (a fresh pool; kvseal's FIFO free list often gives runs), where NIXL
merges the blocks of adjacent pages into one read. UCX picks its transports itself (UCX_TLS in the
environment narrows them, e.g. UCX_TLS=cma,tcp on one host).
Modes, each the whole handoff as the workers run it:
  raw        socket.sendall of the packed bytes -> recv_into one preallocated buffer -> 1-byte ack (the baseline)
  zmq        pack pages + checksums + manifest -> ZeroMQ send -> receive -> verify -> unpack into the pages -> ack
  nixl       checksums over the pages in place + offer (the pages copied into the export window for that decode
             worker, zeroed again at decode's answer) -> decode claims its pages, NIXL READ (UCX, as it picks:
             shared memory on one host) from the window straight into them -> verify in place -> ack
  nixl-tcp   the same with UCX_TLS=tcp: what crosses hosts that have no RDMA
and the same moves without the page checksums on either side (what the transport itself costs; the seals
never run without them): zmq-move (pack, send, unpack), nixl-move, nixl-tcp-move (offer, READ).
With fleet keys (kvseal/auth, what `kvseal serve` runs by default): zmq-mac (the default KV channel with keys: bytes
in clear, an HMAC per message, transfer/kvmac.py), zmq-curve (`--kv-channel curve`: encrypted with ZeroMQ CURVE),
nixl-curve (nixl with its offer and answers over CURVE).
The default KV shape is SmolLM2-135M's (30 layers, 3 KV heads, head_dim 64) in bfloat16.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import socket
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import msgspec
import torch

from benchmarks.common import host_info, markdown_table
from kvseal.auth.keys import MemberKeys, fresh_member
from kvseal.kv.allocator import pages_for
from kvseal.transfer.base import TransferState, Transport, create_transport
from kvseal.transfer.manifest import (
    KVManifest,
    PagePayload,
    PoolPages,
    build_manifest,
    dtype_name,
    page_nbytes,
    unpack_into,
)
from kvseal.transfer.verify import verify, verify_identity
from kvseal.wire.reservation import Reservation, new_nonce, new_reservation_id

FP = "bench-fingerprint"
MODES = ("raw", "zmq", "nixl", "nixl-tcp", "zmq-move", "nixl-move", "nixl-tcp-move", "zmq-mac", "zmq-curve",
         "nixl-curve")


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: str

    @property
    def layout(self) -> str:
        return f"L{self.layers}xPxSx{self.kv_heads}x{self.head_dim}"

    def pool(self, num_pages: int, seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.layers, num_pages, self.page_size, self.kv_heads, self.head_dim)
        dtype = getattr(torch, self.dtype)
        if seed is None:
            return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        g = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _keys(mode: str, own: MemberKeys, peer: MemberKeys) -> MemberKeys | None:
    """The fleet keys of a -curve or -mac mode: this end's keypair, allowing the other end."""
    return own.with_allowed((peer.public,)) if mode.endswith(("-curve", "-mac")) else None


def _transport(mode: str, timeout_s: float = 600.0, keys: MemberKeys | None = None) -> Transport:
    if mode.startswith("zmq"):
        return create_transport("zmq", timeout_s=timeout_s, keys=keys, encrypt=mode == "zmq-curve")
    from kvseal.transfer.nixl import nixl_api

    nixl_api()  # imported first: it sets up its loggers, which would print one INFO line per agent
    logging.getLogger("nixl").setLevel(logging.WARNING)
    return create_transport("nixl", timeout_s=timeout_s, keys=keys)


@contextmanager
def _ucx_tls(mode: str) -> Iterator[None]:
    """UCX reads UCX_TLS when an agent is created: nixl-tcp limits it to TCP, in this process and its children."""
    old = os.environ.get("UCX_TLS")
    if mode.startswith("nixl-tcp"):
        os.environ["UCX_TLS"] = "tcp"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = old


# -- receiver processes (decode side) -----------------------------------------------------------------


def _receiver(mode: str, shape: Shape, pool_pages: int, reservations: list[bytes], out: mp.Queue[object],
              keys: bytes = b"null") -> None:
    pool_k, pool_v = shape.pool(pool_pages, seed=None)
    by_id = {r.request_id: r for r in (msgspec.msgpack.decode(b, type=Reservation) for b in reservations)}

    def claim(m: KVManifest) -> list[int]:
        res = by_id[m.request_id]
        verify_identity(m, res, expected_fingerprint=FP)
        return res.page_ids

    with _transport(mode, keys=msgspec.json.decode(keys, type=MemberKeys | None)) as rx:
        rx.register(pool_k, pool_v)
        out.put((rx.listen("tcp://127.0.0.1:0"), getattr(rx, "kv_session", "")))
        for _ in range(len(reservations)):
            arrival = None
            while arrival is None or arrival.still_landing:  # past its deadline: its end follows
                arrival = rx.recv(60, claim)
            res = by_id[arrival.manifest.request_id]
            check = not mode.endswith("-move")
            if arrival.error is not None:
                arrival.reply(False, arrival.error)
            elif arrival.landed is not None:
                if check:
                    verify(arrival.manifest, res, arrival.landed, expected_fingerprint=FP,
                           page_bytes=page_nbytes(pool_k))
                arrival.reply(True)
            else:
                assert arrival.payload is not None
                if check:
                    verify(arrival.manifest, res, arrival.payload, expected_fingerprint=FP,
                           page_bytes=page_nbytes(pool_k))
                unpack_into(pool_k, pool_v, res.page_ids, arrival.payload)
                arrival.reply(True)


def _tcp_receiver(nbytes: int, rounds: int, out: mp.Queue[object]) -> None:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        out.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            for _ in range(rounds):
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:], nbytes - got)
                    if n == 0:
                        raise ConnectionError("sender closed early")
                    got += n
                conn.sendall(b"k")


# -- sender (prefill side) ----------------------------------------------------------------------------


@dataclass
class Case:
    shape: Shape
    tokens: int
    pages: int  # per transfer
    pool_pages: int
    k: torch.Tensor
    v: torch.Tensor
    gen: torch.Generator
    scattered: bool

    @staticmethod
    def make(shape: Shape, tokens: int, scattered: bool) -> Case:
        n = pages_for(tokens, shape.page_size)
        pool_pages = n + max(n // 2, 1)
        k, v = shape.pool(pool_pages, seed=0)
        return Case(shape, tokens, n, pool_pages, k, v, torch.Generator().manual_seed(1), scattered)

    def page_ids(self) -> list[int]:
        if not self.scattered:  # one run at a random offset
            start = int(torch.randint(0, self.pool_pages - self.pages + 1, (1,), generator=self.gen))
            return list(range(start, start + self.pages))
        return torch.randperm(self.pool_pages, generator=self.gen)[: self.pages].tolist()

    @property
    def nbytes(self) -> int:
        return 2 * self.pages * page_nbytes(self.k)


class _TransportRun:
    """One transport mode: its receiver process, its sender transport, and one reservation per round."""

    endpoint: str
    session: str  # the receiver's KV session (zmq-mac), else ""

    def __init__(self, mode: str, case: Case, rounds: int, ctx: mp.context.SpawnContext) -> None:
        s = case.shape
        self.mode, self.case = mode, case
        self.res = [Reservation(request_id=f"r{i}", reservation_id=new_reservation_id(), nonce=new_nonce(),
                                num_tokens=case.tokens, page_ids=case.page_ids(), model_fingerprint=FP,
                                page_size=s.page_size, kv_dtype=s.dtype, kv_layout=s.layout, kv_endpoint="")
                    for i in range(rounds)]
        q: mp.Queue[object] = ctx.Queue()
        with _ucx_tls(mode):  # the receiver's agent and ours, both created under it
            rx_keys, tx_keys = fresh_member(), fresh_member()
            self.server_key = rx_keys.public if mode.endswith(("-curve", "-mac")) else None
            self.proc = ctx.Process(target=_receiver, args=(mode, s, case.pool_pages,
                                                            [msgspec.msgpack.encode(r) for r in self.res], q,
                                                            msgspec.json.encode(_keys(mode, rx_keys, tx_keys))))
            self.proc.start()
            got = q.get(timeout=300)
            assert isinstance(got, tuple)
            self.endpoint, self.session = str(got[0]), str(got[1])
            self.tx = _transport(mode, keys=_keys(mode, tx_keys, rx_keys))
            self.tx.register(case.k, case.v)

    def one(self, i: int) -> float:
        case, r, tx = self.case, self.res[i], self.tx
        src = PoolPages(case.k, case.v, tuple(case.page_ids()))
        move_only = self.mode.endswith("-move")
        if move_only:  # the manifest (checksums) before the clock: only the move is timed
            man = _manifest(r, src, case)
        t0 = time.perf_counter()
        payload = src.pack() if tx.staged else src
        if not move_only:
            man = _manifest(r, payload, case)
        h = tx.send(self.endpoint, man, payload, server_key=self.server_key, session=self.session or None)
        while not (st := tx.poll(h)).done:
            time.sleep(0.0002)
        if st.state is not TransferState.ACKED:
            raise RuntimeError(f"{self.mode}: transfer failed: {st}")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.tx.close()
        self.proc.join(timeout=60)


def _manifest(r: Reservation, payload: PagePayload | PoolPages, case: Case) -> KVManifest:
    s = case.shape
    return build_manifest(r, payload, num_tokens=case.tokens, first_token=0, model_fingerprint=FP,
                          page_size=s.page_size, kv_dtype=s.dtype, kv_layout=s.layout)


class _RawRun:
    """The baseline: the same bytes (one transfer's packed K and V) over one loopback TCP connection."""

    def __init__(self, case: Case, rounds: int, ctx: mp.context.SpawnContext) -> None:
        payload = PoolPages(case.k, case.v, tuple(case.page_ids())).pack()
        q: mp.Queue[object] = ctx.Queue()
        self.proc = ctx.Process(target=_tcp_receiver, args=(payload.nbytes, rounds, q))
        self.proc.start()
        self.sock = socket.create_connection(("127.0.0.1", int(q.get(timeout=300))))  # type: ignore[call-overload]
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.kb, self.vb = payload.k.numpy().data, payload.v.numpy().data

    def one(self, i: int) -> float:
        t0 = time.perf_counter()
        self.sock.sendall(self.kb)
        self.sock.sendall(self.vb)
        if self.sock.recv(1) != b"k":
            raise ConnectionError("raw receiver did not answer")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()
        self.proc.join(timeout=60)


def run_case(shape: Shape, tokens: int, repeats: int, modes: list[str], scattered: bool) -> dict[str, float]:
    """Median seconds per mode for one (page size, tokens). Every mode's receiver is up at once and the modes
    take turns round by round, so a change in the machine's load touches them all alike; round 0 warms up
    (connections, registrations, prepared descriptor lists) and is not counted."""
    case = Case.make(shape, tokens, scattered)
    rounds = repeats + 1
    ctx = mp.get_context("spawn")
    runs: dict[str, _TransportRun | _RawRun] = {}
    try:
        for m in modes:
            runs[m] = _RawRun(case, rounds, ctx) if m == "raw" else _TransportRun(m, case, rounds, ctx)
        times: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(rounds):
            for m in modes:
                t = runs[m].one(i)
                if i:
                    times[m].append(t)
    finally:
        for run in runs.values():
            run.close()
    out = {m: statistics.median(ts) for m, ts in times.items()}
    out["_bytes"] = float(case.nbytes)
    return out


def report(rows: list[tuple[int, int, dict[str, float]]], shape: Shape, repeats: int, modes: list[str],
           pages: str) -> str:
    others = [m for m in modes if m != "raw"]
    host = host_info()
    head = (f"KV transfer, median of {repeats} per cell ({shape.layout} per page, {shape.dtype}, pages {pages}, "
            f"UCX_TLS={os.environ.get('UCX_TLS', 'default')}); {host['cpu']}, {host['cores']} CPUs; "
            f"GB/s = payload bytes / time, x = raw time / this time")
    cols = ["page", "tokens", "MiB", "raw GB/s", *[f"{m} GB/s" for m in others], *[f"{m} x raw" for m in others]]
    cells = [[str(page), f"{tokens:,}", f"{med['_bytes'] / 2**20:.1f}", f"{med['_bytes'] / med['raw'] / 1e9:.2f}",
              *[f"{med['_bytes'] / med[m] / 1e9:.2f}" for m in others],
              *[f"{med['raw'] / med[m]:.2f}" for m in others]] for page, tokens, med in rows]
    return head + "\n\n" + markdown_table(cols, cells)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1024,4096,16384,32768", help="comma list: prompt tokens per transfer")
    p.add_argument("--page-sizes", default="16,64", help="comma list: tokens per page")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pages", default="scattered", choices=["scattered", "runs"],
                   help="each transfer's page ids: random on both sides, or one run of adjacent pages")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if a.repeats < 1 or not set(modes) <= set(MODES) or "raw" not in modes:
        p.error(f"--repeats must be at least 1 and --modes a comma list of {', '.join(MODES)} with raw in it")
    rows = []
    for page in (int(x) for x in a.page_sizes.split(",")):
        shape = Shape(a.layers, a.kv_heads, a.head_dim, page, dtype_name(getattr(torch, a.dtype)))
        for tokens in (int(x) for x in a.tokens.split(",")):
            rows.append((page, tokens, run_case(shape, tokens, a.repeats, modes, a.pages == "scattered")))
            print(report(rows[-1:], shape, a.repeats, modes, a.pages).splitlines()[-1], flush=True)  # progress
    print()
    print(report(rows, shape, a.repeats, modes, a.pages))


if __name__ == "__main__":
    main()

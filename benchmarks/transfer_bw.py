"""KV transfer bandwidth: the ZeroMQ transport against a raw loopback TCP copy of the same bytes.

    python -m benchmarks.transfer_bw --mb 64 --repeats 5

The receiver (decode side) runs in its own process, the sender (prefill side) in this one; every time is
taken on the sender, from its first step to the receiver's answer, and reported as a median. Modes:
  zmq full       pack pages + checksums + manifest -> send -> receive -> verify (checksums) -> unpack -> ack
  zmq send/recv  an already packed payload and manifest -> send -> receive -> ack
  raw tcp        socket.sendall of the same bytes -> recv_into a preallocated buffer -> 1-byte ack
The default KV shape is SmolLM2-135M's (30 layers, 3 KV heads, head_dim 64) in bfloat16, pages of 16 tokens.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time
from dataclasses import dataclass

import msgspec
import torch

from kvseal.kv.allocator import pages_for
from kvseal.transfer.base import TransferState
from kvseal.transfer.manifest import (
    CHECKSUM_ALGO,
    Reservation,
    build_manifest,
    dtype_name,
    new_nonce,
    new_reservation_id,
    pack_pages,
    page_checksums,
    page_nbytes,
    unpack_into,
    verify,
)
from kvseal.transfer.zmq import ZmqTransport

FP = "bench-fingerprint"


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


# -- receiver processes (decode side) -----------------------------------------------------------------


def _zmq_receiver(shape: Shape, pool_pages: int, reservations: list[bytes], expected: int,
                  out: mp.Queue[object]) -> None:
    pool_k, pool_v = shape.pool(pool_pages, seed=None)
    by_id = {r.request_id: r for r in (msgspec.msgpack.decode(b, type=Reservation) for b in reservations)}
    times: list[tuple[float, float]] = []  # (verify, unpack) seconds of each full transfer
    with ZmqTransport(timeout_s=600) as rx:
        out.put(rx.listen("tcp://127.0.0.1:0"))
        for _ in range(expected):
            arrival = None
            while arrival is None:
                arrival = rx.recv(60)
            res = by_id.get(arrival.manifest.request_id)
            if res is not None:  # a full transfer: verify, then unpack
                t0 = time.perf_counter()
                verify(arrival.manifest, res, arrival.payload, expected_fingerprint=FP,
                       page_bytes=page_nbytes(pool_k))
                t1 = time.perf_counter()
                unpack_into(pool_k, pool_v, res.page_ids, arrival.payload)
                times.append((t1 - t0, time.perf_counter() - t1))
            arrival.reply(True)
    out.put(times)


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


def _wait_acked(tx: ZmqTransport, handle: object) -> None:
    while True:
        status = tx.poll(handle)  # type: ignore[arg-type]
        if status.state is TransferState.ACKED:
            return
        if status.done:
            raise RuntimeError(f"transfer failed: {status}")
        time.sleep(0.0002)


def run(mb: float, repeats: int, shape: Shape) -> dict[str, list[float]]:
    page_bytes = page_nbytes(shape.pool(1, seed=None)[0])
    n = max(1, round(mb * 2**20 / (2 * page_bytes)))  # pages per transfer (K + V)
    pool_pages = 2 * n
    num_tokens = n * shape.page_size
    assert pages_for(num_tokens, shape.page_size) == n
    k, v = shape.pool(pool_pages, seed=0)
    gen = torch.Generator().manual_seed(1)
    rounds = repeats + 1  # the first of each mode warms up and is not timed

    def pages() -> list[int]:  # non-contiguous page ids, as a long-running allocator hands them out
        return torch.randperm(pool_pages, generator=gen)[:n].tolist()

    res = [Reservation(request_id=f"full-{i}", reservation_id=new_reservation_id(), nonce=new_nonce(),
                       num_tokens=num_tokens, page_ids=pages(), model_fingerprint=FP, page_size=shape.page_size,
                       kv_dtype=shape.dtype, kv_layout=shape.layout, kv_endpoint="") for i in range(rounds)]
    ctx = mp.get_context("spawn")
    q: mp.Queue[object] = ctx.Queue()
    proc = ctx.Process(target=_zmq_receiver, args=(shape, pool_pages, [msgspec.msgpack.encode(r) for r in res],
                                                   2 * rounds, q))
    proc.start()
    results: dict[str, list[float]] = {"zmq full": [], "zmq send/recv": [], "pack": [], "checksums": []}
    endpoint = str(q.get(timeout=120))
    with ZmqTransport(timeout_s=600) as tx:
        for i in range(rounds):
            t0 = time.perf_counter()
            payload = pack_pages(k, v, pages())
            t1 = time.perf_counter()
            man = build_manifest(res[i], payload, num_tokens=num_tokens, first_token=0, model_fingerprint=FP,
                                 page_size=shape.page_size, kv_dtype=shape.dtype, kv_layout=shape.layout)
            t2 = time.perf_counter()
            _wait_acked(tx, tx.send(endpoint, man, payload))
            t3 = time.perf_counter()
            if i:
                results["zmq full"].append(t3 - t0)
                results["pack"].append(t1 - t0)
                results["checksums"].append(t2 - t1)
        raw_man = msgspec.structs.replace(man, request_id="raw")
        for i in range(rounds):
            t0 = time.perf_counter()
            _wait_acked(tx, tx.send(endpoint, raw_man, payload))
            if i:
                results["zmq send/recv"].append(time.perf_counter() - t0)
    recv_times = q.get(timeout=120)
    proc.join(timeout=30)
    assert isinstance(recv_times, list)
    results["verify (receiver)"] = [t[0] for t in recv_times[1:]]
    results["unpack (receiver)"] = [t[1] for t in recv_times[1:]]

    # The raw baseline moves the same bytes (K then V, one buffer each) over one loopback TCP connection.
    nbytes = payload.nbytes
    proc = ctx.Process(target=_tcp_receiver, args=(nbytes, rounds, q))
    proc.start()
    port = int(q.get(timeout=120))  # type: ignore[call-overload]
    results["raw tcp"] = []
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        kb, vb = payload.k.numpy().data, payload.v.numpy().data
        for i in range(rounds):
            t0 = time.perf_counter()
            s.sendall(kb)
            s.sendall(vb)
            if s.recv(1) != b"k":
                raise ConnectionError("raw receiver did not answer")
            if i:
                results["raw tcp"].append(time.perf_counter() - t0)
    proc.join(timeout=30)
    results["_bytes"] = [float(nbytes)]
    results["_pages"] = [float(n)]
    assert page_checksums(payload)  # the payload stayed intact through zero-copy sends
    return results


def report(results: dict[str, list[float]], shape: Shape, repeats: int) -> str:
    nbytes, n = results["_bytes"][0], int(results["_pages"][0])
    med = {name: statistics.median(ts) for name, ts in results.items() if not name.startswith("_")}
    lines = [
        (f"KV transfer bandwidth: {nbytes / 2**20:.1f} MiB per transfer = {n} pages of {shape.page_size} tokens "
        f"({shape.layout}, {shape.dtype}); median of {repeats}; checksum {CHECKSUM_ALGO}; "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"),
        f"{'step':<20}{'median s':>10}{'GB/s':>9}{'vs raw tcp':>12}",
    ]
    for name in ("raw tcp", "zmq send/recv", "zmq full", "pack", "checksums", "verify (receiver)",
                 "unpack (receiver)"):
        ratio = med["raw tcp"] / med[name]
        lines.append(f"{name:<20}{med[name]:>10.4f}{nbytes / med[name] / 1e9:>9.2f}{ratio:>12.2f}")
    lines.append("GB/s = payload bytes / time; 'vs raw tcp' = raw tcp time / this time (1.00 = as fast)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=64.0, help="MiB of K+V pages per transfer")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    a = p.parse_args(argv)
    if a.mb <= 0 or a.repeats < 1:
        p.error("--mb must be positive and --repeats at least 1")
    shape = Shape(a.layers, a.kv_heads, a.head_dim, a.page_size, dtype_name(getattr(torch, a.dtype)))
    print(report(run(a.mb, a.repeats, shape), shape, a.repeats))


if __name__ == "__main__":
    main()

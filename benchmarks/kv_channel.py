"""The KV channel alone, without kvseal's handoff around it: one message of SIZE bytes and a 1-byte answer between
two processes over loopback, plain ZeroMQ vs CURVE vs kvseal's MAC framing (keyed BLAKE3 tag over the frames on
send, checked on receive: kvseal/transfer/kvmac.py). The modes take turns round by round; medians.

    python -m benchmarks.kv_channel --mib 64 --rounds 7
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import zmq

from kvseal.transfer.kvmac import KvMac, new_session

MODES = ("plain", "curve", "mac")


def _receiver(q: mp.Queue[int], mode: str, n: int, public: bytes, secret: bytes, session: str) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    if mode == "curve":
        s.curve_server, s.curve_secretkey, s.curve_publickey = True, secret, public
    q.put(s.bind_to_random_port("tcp://127.0.0.1"))
    mac = KvMac(session) if mode == "mac" else None
    for _ in range(n):
        f = s.recv_multipart(copy=False)
        if mac is not None and not mac.check([x.buffer for x in f[1:-1]], f[-1].buffer):
            raise RuntimeError("tag mismatch")
        s.send_multipart([f[0].bytes, b"k"])
    s.close(0)
    ctx.term()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args(argv)
    size = a.mib * 2**20
    spub, ssec = zmq.curve_keypair()
    cpub, csec = zmq.curve_keypair()
    session = new_session()
    payload = memoryview(os.urandom(size))
    ctx = zmq.Context()
    spawn = mp.get_context("spawn")
    socks, procs = {}, []
    for m in MODES:
        q: mp.Queue[int] = spawn.Queue()
        proc = spawn.Process(target=_receiver, args=(q, m, a.rounds + 1, spub, ssec, session))
        proc.start()
        procs.append(proc)
        d = ctx.socket(zmq.DEALER)
        if m == "curve":
            d.curve_serverkey, d.curve_publickey, d.curve_secretkey = spub, cpub, csec
        d.connect(f"tcp://127.0.0.1:{q.get(timeout=120)}")
        socks[m] = d
    mac = KvMac(session)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(a.rounds + 1):  # round 0 warms up (connections, handshakes)
        for m in MODES:
            t0 = time.perf_counter()
            frames: list[bytes | memoryview] = [b"h" * 200, payload]
            if m == "mac":
                frames.append(mac.tag(frames))
            socks[m].send_multipart(frames, copy=False)
            socks[m].recv()
            if i:
                times[m].append(time.perf_counter() - t0)
    for proc in procs:
        proc.join(60)
    for d in socks.values():
        d.close(0)
    ctx.term()
    med = {m: statistics.median(ts) for m, ts in times.items()}
    print(f"{a.mib} MiB, median of {a.rounds}: " + ", ".join(
        f"{m} {size / med[m] / 1e9:.2f} GB/s ({med['plain'] / med[m]:.2f}x plain)" for m in MODES))


if __name__ == "__main__":
    main()

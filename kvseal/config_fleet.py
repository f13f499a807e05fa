"""Frozen configuration of the fleet's processes, one dataclass per concern, as kvseal/config.py is the engine's
and the HTTP server's: every process (log level, test faults), a worker's sockets and lifetime, the KV transport,
one request's handoff as the router bounds it, the router's fleet, the fleet `kvseal serve` starts, and its embed
worker.

Every field that is a flag is declared with `opt` (its help text is the flag's); kvseal/config_args.py builds the
flags and the configs back. A worker gets these objects as they are, in its `worker/run.py` `WorkerSpec`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvseal.config import _need, opt

LOG_LEVELS = ("debug", "info", "warning", "error")
KV_TRANSPORTS = ("zmq", "nixl")
KV_CHANNELS = ("mac", "curve")
THREADS_HELP = ("CPU threads for torch and the kernels in this process (default: `kvseal serve` splits the cores "
                "among its workers; `kvseal serve --unified` steps its engine on every core)")


def _port(name: str, value: int, lowest: int = 0) -> None:
    _need(lowest <= value < 65536, name, value, f"give a TCP port {lowest}-65535" + (" (0: any free port)"
                                                                                     if lowest <= 0 else ""))


def _seconds(name: str, value: float) -> None:
    _need(value > 0, name, value, "give a positive number of seconds")


def _threads(name: str, value: int | None) -> None:
    _need(value is None or value >= 0, name, value, "give a number of threads (or leave it out for the default)")


@dataclass(frozen=True)
class ProcessConfig:
    """What every kvseal process runs with, whatever its role."""

    log_level: str = opt("info", None, choices=list(LOG_LEVELS))  # no help text: the choices say it all
    # test-only, absent from --help on purpose (kvseal/faults.py); None in production
    test_faults: str | None = opt(None, argparse.SUPPRESS)

    def __post_init__(self) -> None:
        _need(self.log_level in LOG_LEVELS, "log_level", self.log_level, f"use one of {', '.join(LOG_LEVELS)}")


@dataclass(frozen=True)
class WorkerConfig:
    """One prefill or decode worker process: its control socket, how others reach it, its threads, its lifetime."""

    threads: int | None = opt(None, THREADS_HELP)  # None: torch's default
    host: str = opt("127.0.0.1", "address of the control socket")
    port: int = opt(0, "control port (0: any free port)")
    router: str | None = opt(None, "join a running router at its fleet endpoint (its --fleet-port); the router "
                             "checks this worker like one it started with (seal 7) and exits it with the reason if "
                             "not. With --fleet-keys, NAME is the router's member (default: router), whose key the "
                             "join pins", metavar="[NAME@]HOST:PORT")
    metrics_port: int = opt(0, "serve Prometheus /metrics on this port of --host (0: any free port, shown in the "
                            "log and in /info as metrics_endpoint; -1: none)")
    # the address the router (and, for decode's KV port, prefill) connects to; None: host and kv_host
    advertise_host: str | None = opt(None, "the address others connect to: the router's to the control port, and "
                                     "for a decode worker prefill's to the KV port (default: --host and --kv-host; "
                                     "give the host's name or address when they bind 0.0.0.0, as in a pod)")
    drain_timeout_s: float = opt(600.0, "on SIGTERM or `kvseal drain`, seconds to finish the requests in flight "
                                 "before the rest fail", flag="--drain-timeout")

    def __post_init__(self) -> None:
        _threads("threads", self.threads)
        _need(bool(self.host), "host", self.host, "give the address of the control socket (e.g. 127.0.0.1)")
        _port("port", self.port)
        _need(self.router is None or bool(self.router.rpartition("@")[2]), "router", self.router,
              "give the router's fleet endpoint as [NAME@]HOST:PORT (its --fleet-port)")
        _port("metrics_port", self.metrics_port, lowest=-1)
        _need(self.drain_timeout_s >= 0, "drain_timeout_s", self.drain_timeout_s,
              "give the seconds a drain waits for the requests in flight (0: none)")


@dataclass(frozen=True)
class TransportConfig:
    """How KV pages move from prefill to decode, and how long each side waits for the other."""

    kv_transport: str = opt("zmq", "how KV pages move from prefill to decode workers: zmq (ZeroMQ over TCP, a packed "
                            "copy) or nixl (NIXL over UCX: RDMA, shared memory or TCP; decode reads straight into "
                            "its reserved pages; pip install 'kvseal[nixl]'). Every worker of a fleet uses the same "
                            "one", choices=list(KV_TRANSPORTS))
    # decode chooses; prefill follows its reservations
    kv_channel: str = opt("mac", "with fleet keys and --kv-transport zmq, how the KV pages cross (the decode worker "
                          "chooses; prefill follows its reservations): mac: in clear, every message with an HMAC "
                          "and the connection with a session token (the KV transfer at near full speed); curve: "
                          "encrypted (ZeroMQ CURVE; 0.33-0.50x of the KV transfer's speed, mac 0.50-0.68x: "
                          "docs/benchmarks.md). NIXL's offers are always encrypted; its UCX data path never is",
                          choices=list(KV_CHANNELS))
    kv_host: str | None = opt(None, "address for incoming KV (default: --host)")  # decode
    kv_port: int = opt(0, "port for incoming KV (0: any free port)")  # decode
    transfer_timeout_s: float = opt(60.0, "seconds to wait for decode to acknowledge a KV handoff",
                                    flag="--transfer-timeout")  # prefill
    reservation_timeout_s: float = opt(120.0, "seconds a page reservation waits for its KV before it is released",
                                       flag="--reservation-timeout")  # decode

    def __post_init__(self) -> None:
        _need(self.kv_transport in KV_TRANSPORTS, "kv_transport", self.kv_transport, "use zmq or nixl")
        _need(self.kv_channel in KV_CHANNELS, "kv_channel", self.kv_channel, "use mac or curve")
        _need(self.kv_host is None or bool(self.kv_host), "kv_host", self.kv_host,
              "give an address for incoming KV, or leave it out for --host")
        _port("kv_port", self.kv_port)
        _seconds("transfer_timeout_s", self.transfer_timeout_s)
        _seconds("reservation_timeout_s", self.reservation_timeout_s)


@dataclass(frozen=True)
class HandoffTimeouts:
    """How long the router waits on one request's handoff and stream (router/disagg_request.py)."""

    handoff_s: float = opt(600.0, "seconds from the start of a request's KV handoff to its first token from decode; "
                           "past it the router asks decode whether it still holds the request, and fails it (504 "
                           "transfer_timeout) if not", flag="--handoff-timeout")
    stall_s: float = opt(120.0, "seconds between a request's later tokens from decode; past it the router asks "
                         "decode whether it still holds the request (waiting for pages, preempted), and fails it if "
                         "not", flag="--stall-timeout")
    # at most this, and at most a quarter of decode's reservation timeout
    renew_every_s: float = opt(10.0, "while a prompt waits in prefill's queue, seconds between renewals of its page "
                               "reservation on decode (at most a quarter of decode's --reservation-timeout)",
                               flag="--renew-every")

    def __post_init__(self) -> None:
        _seconds("handoff_s", self.handoff_s)
        _seconds("stall_s", self.stall_s)
        _seconds("renew_every_s", self.renew_every_s)


@dataclass(frozen=True)
class RouterConfig:
    """The router's fleet: the workers it starts with, where others join, how long it waits for them."""

    prefill: tuple[str, ...] = opt((), "a prefill worker's control endpoint (repeatable); with --fleet-keys, NAME is "
                                   "its member (default: prefill), whose key the router pins", action="append",
                                   metavar="[NAME@]HOST:PORT")
    decode: tuple[str, ...] = opt((), "a decode worker's control endpoint (repeatable); NAME as for --prefill "
                                  "(default: decode)", action="append", metavar="[NAME@]HOST:PORT")
    fleet_port: int = opt(0, "port where workers started with --router HOST:PORT join (0: any free port; the one "
                          "chosen is in the log and in /info as fleet_endpoint)")
    fleet_host: str | None = opt(None, "address of the fleet port (default: --host)")
    startup_timeout_s: float = opt(300.0, "seconds the router waits at start for the workers it starts with to "
                                   "answer (workers still loading their model) before it refuses to start",
                                   flag="--startup-timeout")

    def __post_init__(self) -> None:
        _port("fleet_port", self.fleet_port)
        _need(self.fleet_host is None or bool(self.fleet_host), "fleet_host", self.fleet_host,
              "give an address for the fleet port, or leave it out for --host")
        _seconds("startup_timeout_s", self.startup_timeout_s)


@dataclass(frozen=True)
class ServeConfig:
    """The fleet `kvseal serve` starts on this host: one process, or prefill and decode worker processes."""

    unified: bool = opt(False, "run prefill and decode in one process (the single-process engine)",
                        action="store_true")
    prefill: int = opt(1, "prefill worker processes", metavar="N")
    decode: int = opt(1, "decode worker processes", metavar="M")
    prefill_kv_pool_tokens: int | None = opt(None, "a different KV pool size for the prefill workers (default: "
                                             "--kv-pool-tokens)")
    prefill_threads: int | None = opt(None, "CPU threads per prefill worker (default: --threads, else the cores "
                                      "split evenly among the workers)")
    decode_threads: int | None = opt(None, "CPU threads per decode worker (default: as --prefill-threads)")
    # worker/cores.py: a worker with work steps on its own threads plus those of the workers with none
    lend_cores: bool = opt(True, "keep each worker on its own threads; by default a worker with work borrows the "
                           "threads of the workers on this host that have none (a lone long prompt is prefilled on "
                           "every core), and gives them back at its next step once their owner has work again. "
                           "Only with the fast arithmetic, whose results do not depend on the thread count",
                           flag="--no-lend-cores", action="store_false", dest="lend_cores")

    def __post_init__(self) -> None:
        _need(self.prefill >= 1, "prefill", self.prefill, "give at least 1 prefill worker")
        _need(self.decode >= 1, "decode", self.decode, "give at least 1 decode worker")
        _threads("prefill_threads", self.prefill_threads)
        _threads("decode_threads", self.decode_threads)


@dataclass(frozen=True)
class EmbedConfig:
    """`kvseal serve --embed-model PATH`: the embedding model served beside the chat model, and its worker's
    settings (kvseal/embed/, docs/embeddings.md)."""

    model: str | None = opt(None, "also serve /v1/embeddings with this sentence-transformers folder (a BERT "
                            "encoder with its pooling config, e.g. all-MiniLM-L6-v2), in an embed worker process "
                            "beside the chat model (docs/embeddings.md)", flag="--embed-model")
    served_name: str | None = opt(None, "the embedding model's id in the API (default: the folder's name)",
                                  flag="--embed-model-name")
    threads: int | None = opt(None, "CPU threads of the embed worker (default: every core; it computes only while "
                              "embeddings are asked for)", flag="--embed-threads")
    batch_tokens: int = opt(8192, "tokens in one forward pass of the embed worker: larger batches are faster, and a "
                            "request of another tenant waits at most one batch", flag="--embed-batch-tokens")

    def __post_init__(self) -> None:
        _need(self.threads is None or self.threads >= 1, "embed_threads", self.threads, "give at least 1 thread")
        _need(self.batch_tokens >= 512, "embed_batch_tokens", self.batch_tokens,
              "give at least 512 tokens (a batch must hold the longest input)")

"""`kvseal serve`'s worker settings: threads per role and the WorkerSpec each worker is started with."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from kvseal.cli import build_parser
from kvseal.cli.serve import worker_specs, worker_threads
from kvseal.config_args import engine_config
from kvseal.config_fleet import TransportConfig
from kvseal.worker.run import WorkerSpec


def test_threads_split_evenly_by_default_and_per_role_flags_win() -> None:
    p = build_parser()
    assert worker_threads(p.parse_args(["serve"]), cores=2) == (1, 1)
    assert worker_threads(p.parse_args(["serve"]), cores=16) == (8, 8)
    assert worker_threads(p.parse_args(["serve", "--prefill", "2", "--decode", "2"]), cores=16) == (4, 4)
    assert worker_threads(p.parse_args(["serve", "--threads", "3"]), cores=2) == (3, 3)
    assert worker_threads(p.parse_args(["serve", "--decode-threads", "2"]), cores=2) == (1, 2)
    assert worker_threads(p.parse_args(["serve", "--threads", "4", "--prefill-threads", "1"]), cores=2) == (1, 4)


def test_workers_get_the_engine_config_as_one_message() -> None:
    a = build_parser().parse_args(["serve", "--arithmetic", "exact", "--kv-dtype", "bfloat16", "--threads", "2",
                                   "--kv-pool-tokens", "8192", "--prefill-kv-pool-tokens", "4096",
                                   "--max-model-len", "1024", "--no-prefix-cache", "--test-faults", "no_scrub"])
    prefill, decode = worker_specs(a, cores=2)
    assert decode.engine == engine_config(a)  # the parent's frozen config as it is, nothing rebuilt
    assert decode.engine.model.arithmetic == "exact" and decode.engine.cache.kv_dtype == "bfloat16"
    assert not decode.engine.cache.prefix_cache and decode.engine.model.max_model_len == 1024
    assert prefill.engine.cache.pool_tokens == 4096 and decode.engine.cache.pool_tokens == 8192
    assert (prefill.role, decode.role, prefill.worker.threads, decode.worker.threads) == ("prefill", "decode", 2, 2)
    assert prefill.process.test_faults == decode.process.test_faults == "no_scrub"
    wire = msgspec.json.encode(decode)  # what launch.Fleet writes to the worker's stdin
    assert msgspec.json.decode(wire, type=WorkerSpec) == decode
    with pytest.raises(msgspec.ValidationError, match="page_size"):  # validated again on arrival
        msgspec.json.decode(wire.replace(b'"page_size":16', b'"page_size":3'), type=WorkerSpec)
    assert engine_config(build_parser().parse_args(["prefill"])).model.arithmetic == "auto"


def test_kv_dtype_auto_is_bfloat16_under_the_fast_arithmetic_only() -> None:
    from kvseal.engine.devices import resolve_kv_dtype

    assert resolve_kv_dtype("auto", "float32", fast=True) == "bfloat16"
    assert resolve_kv_dtype("auto", "float32", fast=False) == "float32"  # exact keeps its float32 reference
    assert resolve_kv_dtype("float32", "float32", fast=True) == "float32"  # an explicit choice stands


def test_a_worker_refuses_a_bad_start_message() -> None:
    p = subprocess.run([sys.executable, "-m", "kvseal.worker.run"], input=b'{"role": "router"}',
                       capture_output=True, timeout=60, check=False)
    assert p.returncode == 2 and b"refusing its start message" in p.stderr


def test_serve_starts_every_worker_with_its_kv_transport() -> None:
    for flags, want in (([], "zmq"), (["--kv-transport", "nixl"], "nixl")):
        prefill, decode = worker_specs(build_parser().parse_args(["serve", *flags]), 2)
        assert prefill.transport.kv_transport == decode.transport.kv_transport == want
        # what the worker process decodes from its stdin is what the parent sent
        assert msgspec.json.decode(msgspec.json.encode(decode), type=WorkerSpec).transport.kv_transport == want
    assert build_parser().parse_args(["decode", "--kv-transport", "nixl"]).kv_transport == "nixl"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["prefill", "--kv-transport", "rdma"])
    with pytest.raises(ValueError, match="kv_transport"):
        WorkerSpec(role="decode", engine=prefill.engine, transport=TransportConfig(kv_transport="rdma"))
    with pytest.raises(msgspec.ValidationError, match="kv_transport"):  # and on arrival, in the start message
        msgspec.json.decode(msgspec.json.encode(decode).replace(b'"nixl"', b'"rdma"'), type=WorkerSpec)

"""`kvseal serve`'s worker settings: threads per role and the engine flags each worker is started with."""

from __future__ import annotations

from kvseal.cli import _without, build_parser, engine_argv, engine_config, worker_threads


def test_threads_split_evenly_by_default_and_per_role_flags_win() -> None:
    p = build_parser()
    assert worker_threads(p.parse_args(["serve"]), cores=2) == (1, 1)
    assert worker_threads(p.parse_args(["serve"]), cores=16) == (8, 8)
    assert worker_threads(p.parse_args(["serve", "--prefill", "2", "--decode", "2"]), cores=16) == (4, 4)
    assert worker_threads(p.parse_args(["serve", "--threads", "3"]), cores=2) == (3, 3)
    assert worker_threads(p.parse_args(["serve", "--decode-threads", "2"]), cores=2) == (1, 2)
    assert worker_threads(p.parse_args(["serve", "--threads", "4", "--prefill-threads", "1"]), cores=2) == (1, 4)


def test_workers_get_the_arithmetic_and_kv_dtype_flags() -> None:
    a = build_parser().parse_args(["serve", "--arithmetic", "exact", "--kv-dtype", "bfloat16", "--threads", "2"])
    argv = engine_argv(a)
    assert argv[argv.index("--arithmetic") + 1] == "exact" and argv[argv.index("--kv-dtype") + 1] == "bfloat16"
    assert "--threads" not in _without(argv, "--threads") and "2" not in _without(argv, "--threads")
    worker = build_parser().parse_args(["decode", *argv])
    cfg = engine_config(worker)
    assert cfg.model.arithmetic == "exact" and cfg.cache.kv_dtype == "bfloat16"
    assert engine_config(build_parser().parse_args(["prefill"])).model.arithmetic == "auto"


def test_kv_dtype_auto_is_bfloat16_under_the_fast_arithmetic_only() -> None:
    from kvseal.engine.engine import resolve_kv_dtype

    assert resolve_kv_dtype("auto", "float32", fast=True) == "bfloat16"
    assert resolve_kv_dtype("auto", "float32", fast=False) == "float32"  # exact keeps its float32 reference
    assert resolve_kv_dtype("float32", "float32", fast=True) == "float32"  # an explicit choice stands

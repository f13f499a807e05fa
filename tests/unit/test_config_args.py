"""One configuration front door: every engine setting is a field of kvseal/config.py, its flag is built from the
field (name, type, default, help), and `kvseal serve`, the worker roles and `kvseal.LLM(**options)` build the same
frozen EngineConfig from the same values."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvseal.cli import build_parser
from kvseal.config import EngineConfig, LedgerConfig, ServerConfig
from kvseal.config_args import (
    ENGINE_PARTS,
    LLM_PARTS,
    dest,
    engine_config,
    engine_config_from_options,
    flag_fields,
)

# a value other than the default for every field kvseal.LLM takes, as a flag would give it
NOT_DEFAULT = {
    "path": "/models/m.gguf", "dtype": "bfloat16", "device": "cpu", "max_model_len": 1024, "served_name": "m",
    "kernels": "torch", "arithmetic": "exact", "page_size": 32, "pool_tokens": 4096, "pool_bytes": None,
    "scrub": False, "kv_dtype": "float32", "prefix_cache": False,
    "window_pages": False, "max_num_seqs": 8, "max_num_batched_tokens": 128,
    "max_waiting": 7, "wait_timeout_s": 5.0, "fairness": "off", "contended_chunk_tokens": 64,
    "speculative": "off", "speculative_rows": 6,
    "grammar_compilers": 3, "grammar_timeout_s": 2.5,
    "grammar_max_bytes": 999, "seed": 11,
}


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _flag_args(values: dict[str, object]) -> list[str]:
    """The command line that sets each field in `values` through its own flag."""
    args: list[str] = []
    for cls in (*ENGINE_PARTS.values(), EngineConfig):
        for f in flag_fields(cls):
            if f.name not in values or values[f.name] is None or f.name == "path":
                continue
            spec = f.metadata["cli"]
            flag = spec["flag"] or "--" + f.name.replace("_", "-")
            if spec.get("action") == "store_false":
                args.append(flag)
            elif isinstance(values[f.name], bool):
                args += [flag, "on" if values[f.name] else "off"]
            else:
                args += [flag, str(values[f.name])]
    return args


def test_every_engine_setting_is_a_field_with_its_flag_and_help() -> None:
    # a new field of an engine config is a flag of every engine command, with its help text, or the test fails
    for cls in (*ENGINE_PARTS.values(), EngineConfig):
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(cls) and f.name in ENGINE_PARTS and cls is EngineConfig:
                continue  # the parts themselves
            assert "cli" in f.metadata and f.metadata["cli"]["help"], f"{cls.__name__}.{f.name} has no flag"
    for command in ("serve", "prefill", "decode"):
        helps = {a.dest: a.help for a in _subparser(command)._actions}
        for cls in (*ENGINE_PARTS.values(), EngineConfig):
            for f in flag_fields(cls):
                assert helps.get(dest(f)) == f.metadata["cli"]["help"], (command, f.name)
    # the server's flags too (its keys come from the --api-keys file, not flags of their own)
    assert {f.name for f in flag_fields(ServerConfig)} == {"host", "port", "max_body_bytes", "tenant_body_bytes",
                                                          "text_threads", "text_threads_per_tenant", "state",
                                                          "state_password_file", "state_secret_file", "state_lease_s"}


@pytest.mark.parametrize("command", ["serve", "prefill", "decode"])
def test_the_cli_and_llm_build_the_same_engine_config(command: str) -> None:
    p = build_parser()
    llm_values = {k: v for k, v in NOT_DEFAULT.items() if k != "path"}
    a = p.parse_args([command, "/models/m.gguf", *_flag_args(NOT_DEFAULT), "--ledger", "off"])
    from_cli = engine_config(a)
    assert from_cli == engine_config_from_options("/models/m.gguf", llm_values)
    # every value arrived (a flag that no longer reached its field would leave the default here)
    for name, cls in LLM_PARTS.items():
        part = getattr(from_cli, name)
        for f in dataclasses.fields(cls):
            assert getattr(part, f.name) == NOT_DEFAULT[f.name], (name, f.name)
    assert from_cli.seed == 11 and from_cli.ledger == LedgerConfig(None)
    # and the defaults agree too
    assert engine_config(p.parse_args([command, "--ledger", "off"])) == engine_config_from_options(None, {})


def test_the_ledger_is_on_by_default_for_serve_only_and_off_turns_it_off() -> None:
    p = build_parser()
    assert engine_config(p.parse_args(["serve"])).ledger.path  # kvseal serve keeps a ledger unless told not to
    assert engine_config(p.parse_args(["serve", "--ledger", "off"])).ledger.path is None
    assert engine_config(p.parse_args(["prefill"])).ledger.path is None
    assert engine_config(p.parse_args(["decode", "--ledger", "/tmp/l.db"])).ledger.path == "/tmp/l.db"


def test_a_bad_value_is_refused_by_the_flag_or_by_the_config_naming_the_field() -> None:
    p = build_parser()
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--kv-dtype", "int4"])  # choices from the field
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--max-num-seqs", "many"])  # type from the field's annotation
    with pytest.raises(ValueError, match="page_size"):
        engine_config(p.parse_args(["serve", "--page-size", "3"]))
    with pytest.raises(TypeError, match="unknown engine options"):
        engine_config_from_options(None, {"page_sise": 16})

"""Command-line flags built from the config dataclasses' fields (the `opt` metadata of kvseal/config.py and
kvseal/config_fleet.py), and the configs built back from them: one front door for `kvseal serve`, the worker roles,
the router and `kvseal.LLM`.

A field's flag is --its-name unless its metadata names another; its type, default and help come from the field. The
parsed value lands in the namespace under the flag's name (`--kv-pool-tokens` -> `a.kv_pool_tokens`, the positional
`model` -> `a.model`), so building a config back is one loop for every class and no flag is copied by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

from kvseal.config import (
    CacheConfig,
    EngineConfig,
    GrammarConfig,
    LedgerConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)

C = TypeVar("C")
_RECORD = "_config_fields"  # in a parsed namespace: {config class: the names of its fields that are flags}
# EngineConfig's parts that kvseal.LLM takes by field name (the ledger is a server's: flags only)
LLM_PARTS: dict[str, type] = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                              "grammar": GrammarConfig}
ENGINE_PARTS: dict[str, type] = {**LLM_PARTS, "ledger": LedgerConfig}


def on_off(v: str) -> bool:
    if v.lower() in ("on", "true", "1", "yes"):
        return True
    if v.lower() in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {v!r}")


def flag_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of a config class that are flags (those with `opt` metadata), in order."""
    return [f for f in dataclasses.fields(cls) if "cli" in f.metadata]


def flag_name(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata["cli"]["flag"] or "--" + f.name.replace("_", "-"))


def dest(f: dataclasses.Field[Any]) -> str:
    """Where a field's flag lands in the parsed namespace."""
    return str(f.metadata["cli"].get("dest") or flag_name(f).lstrip("-").replace("-", "_"))


def add_config_args(p: argparse.ArgumentParser, cls: type, only: tuple[str, ...] | None = None,
                    **defaults: Any) -> None:
    """One flag per flag field of `cls` (or per field named in `only`); `defaults` replaces a field's default as
    its flag's (the ledger's path under `kvseal serve`). The parser's namespace records which fields of `cls` it
    has as flags, so that config_from_args reads those and no other class's flag of the same name."""
    hints = typing.get_type_hints(cls)
    added: list[str] = []
    for f in flag_fields(cls):
        if only is not None and f.name not in only:
            continue
        added.append(f.name)
        spec = {k: v for k, v in f.metadata["cli"].items() if k not in ("flag", "dest")}
        default = defaults.get(f.name, f.default)
        name = flag_name(f)
        if not name.startswith("-"):  # a positional (the model): optional, its dest is its name
            p.add_argument(name, nargs="?", default=default, **spec)
            continue
        if spec.get("action") == "append":  # a repeatable flag: a tuple field, its values appended to a list
            spec["type"] = _base_type(typing.get_args(hints[f.name])[0])
            default = list(default)
        elif "action" not in spec:
            kind = _base_type(hints[f.name])
            spec["type"] = on_off if kind is bool else kind
            if kind is bool:
                spec.setdefault("metavar", "on|off")
        p.add_argument(name, dest=dest(f), default=default, **spec)
    record = dict(p.get_default(_RECORD) or {})
    record[cls] = (*record.get(cls, ()), *added)
    p.set_defaults(**{_RECORD: record})


def config_args_of(cls: type, a: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` that this command has as flags (add_config_args recorded them), as parsed into `a`."""
    fields = {f.name: f for f in flag_fields(cls)}
    return {name: _frozen(getattr(a, dest(fields[name]))) for name in getattr(a, _RECORD, {}).get(cls, ())}


def config_from_args(cls: type[C], a: argparse.Namespace) -> C:
    """`cls` from the flags parsed into `a` (a field whose flag this command lacks keeps its default)."""
    return cls(**config_args_of(cls, a))


def add_engine_args(p: argparse.ArgumentParser, ledger_default: str | None = None) -> None:
    """Every EngineConfig flag: model, cache, scheduler, grammar, ledger and seed."""
    for cls in LLM_PARTS.values():
        add_config_args(p, cls)
    add_config_args(p, LedgerConfig, path=ledger_default)
    add_config_args(p, EngineConfig)


def ledger_path(a: argparse.Namespace) -> str | None:
    """--ledger PATH, or None for off (whatever the command's default)."""
    return None if a.ledger in (None, "", "off") else str(a.ledger)


def engine_config(a: argparse.Namespace) -> EngineConfig:
    parts: dict[str, Any] = {name: config_from_args(cls, a) for name, cls in LLM_PARTS.items()}
    return EngineConfig(**parts, ledger=LedgerConfig(ledger_path(a)), **config_args_of(EngineConfig, a))


def engine_config_from_options(model: str | None, options: dict[str, Any]) -> EngineConfig:
    """EngineConfig from keyword options named like the config fields (kvseal.LLM: the same fields as the flags,
    by field name); an unknown name is a TypeError."""
    rest = dict(options)
    parts: dict[str, Any] = {}
    for name, cls in LLM_PARTS.items():
        kw = {f.name: rest.pop(f.name) for f in dataclasses.fields(cls) if f.name in rest}
        parts[name] = cls(**({**kw, "path": model} if cls is ModelConfig else kw))
    seed = rest.pop("seed", EngineConfig.seed)
    if rest:
        raise TypeError(f"LLM() got unknown engine options {sorted(rest)}; give fields of kvseal.config's "
                        f"ModelConfig, CacheConfig, SchedulerConfig or GrammarConfig, or seed")
    return EngineConfig(**parts, seed=seed)


def server_config(a: argparse.Namespace, **rest: Any) -> ServerConfig:
    """ServerConfig from the flags, and what the flags do not give directly (the keys read from --api-keys)."""
    return ServerConfig(**config_args_of(ServerConfig, a), **rest)


def check_args(a: argparse.Namespace) -> None:
    """Build every config whose fields are this command's flags, so that a bad setting stops the command before
    anything starts (ValueError naming the field, the value and the fix)."""
    for cls in getattr(a, _RECORD, {}):
        config_from_args(cls, a)


def _frozen(v: Any) -> Any:
    """A repeatable flag's list as the tuple its frozen field holds."""
    return tuple(v) if isinstance(v, list) else v


def _base_type(t: Any) -> type:
    """int for `int | None`, str for `str`, and so on."""
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        args = [x for x in typing.get_args(t) if x is not type(None)]
        assert len(args) == 1, t
        t = args[0]
    assert isinstance(t, type), t
    return t

"""Every setting in config (issue 31 item 5): each flag of serve, prefill, decode and router is built from a field
of kvseal/config.py or kvseal/config_fleet.py (its name, default, choices and help from the field), except the
files read at start that cli/base.py lists; a worker runs with the config objects its flags build, in one
WorkerSpec, and the router with the RouterConfig and HandoffTimeouts of its flags."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from typing import Any

import msgspec
import pytest

import kvseal.config
import kvseal.config_fleet
from kvseal.cli import build_parser, main
from kvseal.cli.base import HAND_WRITTEN
from kvseal.cli.router import router_backend
from kvseal.cli.worker import worker_spec
from kvseal.config import ServerConfig
from kvseal.config_args import config_from_args, engine_config_from_options, flag_fields, flag_name
from kvseal.config_fleet import (
    HandoffTimeouts,
    ProcessConfig,
    RouterConfig,
    ServeConfig,
    TransportConfig,
    WorkerConfig,
)
from kvseal.worker.run import WorkerSpec

from .test_config_args import NOT_DEFAULT, _flag_args

COMMANDS = ("serve", "prefill", "decode", "router")
CONFIGS = [c for m in (kvseal.config, kvseal.config_fleet) for _, c in inspect.getmembers(m, dataclasses.is_dataclass)
           if c.__module__ == m.__name__ and flag_fields(c)]
FLEET = (ProcessConfig, WorkerConfig, TransportConfig, HandoffTimeouts, RouterConfig, ServeConfig)
# a value other than the default for every field of the worker's configs, as its flag would give it
WORKER_NOT_DEFAULT: dict[str, Any] = {
    "threads": 3, "host": "localhost", "port": 7001, "router": "10.0.0.9:7100", "metrics_port": -1,
    "advertise_host": "w1.example", "drain_timeout_s": 30.0, "kv_transport": "nixl", "kv_channel": "curve",
    "kv_host": "127.0.0.3", "kv_port": 7002, "transfer_timeout_s": 5.0, "reservation_timeout_s": 8.0,
    "log_level": "debug", "test_faults": "no_scrub",
}


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _field_of(action: argparse.Action) -> dataclasses.Field[Any] | None:
    """The config field this flag was built from: same name and the field's own help text."""
    name = action.option_strings[0] if action.option_strings else action.dest
    found = [f for c in CONFIGS for f in flag_fields(c)
             if flag_name(f) == name and f.metadata["cli"]["help"] == action.help]
    assert len(found) <= 1, (name, found)
    return found[0] if found else None


def _args(classes: tuple[type, ...], values: dict[str, Any], only: set[str]) -> list[str]:
    """The command line that sets each field in `values` (of those this command has: `only`) through its flag."""
    args: list[str] = []
    for cls in classes:
        for f in flag_fields(cls):
            if f.name in values and flag_name(f) in only:
                args += [flag_name(f), str(values[f.name])]
    return args


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_a_fleet_command_comes_from_a_config_field_or_is_a_file_read_at_start(command: str) -> None:
    hand = set()
    for action in _subparser(command)._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        f = _field_of(action)
        if f is None:
            hand.add(action.option_strings[0])
            continue
        spec = f.metadata["cli"]
        want = list(f.default) if spec.get("action") == "append" else f.default
        if flag_name(f) != "--ledger":  # `kvseal serve` keeps a ledger by default (test_config_args checks it)
            assert action.default == want, (command, action.dest)
        assert action.choices == spec.get("choices"), (command, action.dest)
        assert action.metavar == spec.get("metavar", "on|off" if isinstance(f.default, bool) and
                                          "action" not in spec else None), (command, action.dest)
    assert hand <= set(HAND_WRITTEN), f"{command}: flags written by hand that no config field declares: " \
                                      f"{sorted(hand - set(HAND_WRITTEN))}"


def test_the_documented_exceptions_are_exactly_the_hand_written_flags() -> None:
    hand = {a.option_strings[0] for c in COMMANDS for a in _subparser(c)._actions
            if not isinstance(a, argparse._HelpAction) and _field_of(a) is None}
    assert hand == set(HAND_WRITTEN)  # a stale exception fails too


def test_every_setting_of_the_fleet_is_a_flag_of_some_command_with_its_help() -> None:
    flags = {(a.option_strings[0] if a.option_strings else a.dest, a.help) for c in COMMANDS
             for a in _subparser(c)._actions}
    for cls in FLEET:
        for f in dataclasses.fields(cls):
            assert "cli" in f.metadata, f"{cls.__name__}.{f.name} is not a flag"
            assert (flag_name(f), f.metadata["cli"]["help"]) in flags, (cls.__name__, f.name)
            assert f.name == "log_level" or f.metadata["cli"]["help"], (cls.__name__, f.name)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_runs_with_the_configs_its_flags_build_in_one_message(role: str) -> None:
    have = {a.option_strings[0] for a in _subparser(role)._actions if a.option_strings}
    a = build_parser().parse_args([role, "/models/m.gguf", *_flag_args(NOT_DEFAULT), "--ledger", "off",
                                   *_args((ProcessConfig, WorkerConfig, TransportConfig), WORKER_NOT_DEFAULT, have)])
    spec = worker_spec(a)
    # every value given arrived in the spec's config objects (a flag that no longer reached its field would leave
    # the default there), and the fields the role has no flag for keep their defaults
    for name, cls in (("worker", WorkerConfig), ("transport", TransportConfig), ("process", ProcessConfig)):
        got = getattr(spec, name)
        for f in dataclasses.fields(cls):
            want = WORKER_NOT_DEFAULT[f.name] if flag_name(f) in have else f.default
            assert getattr(got, f.name) == want, (role, name, f.name)
    assert {"--kv-port", "--reservation-timeout", "--kv-channel"} <= have if role == "decode" else \
        "--transfer-timeout" in have and "--kv-port" not in have
    # the engine config the CLI builds is kvseal.LLM's for the same values
    assert spec.engine == engine_config_from_options("/models/m.gguf",
                                                     {k: v for k, v in NOT_DEFAULT.items() if k != "path"})
    assert msgspec.json.decode(msgspec.json.encode(spec), type=WorkerSpec) == spec  # what a launcher would send


def test_serve_hands_its_workers_the_transport_and_process_configs_of_its_flags() -> None:
    from kvseal.cli.serve import worker_specs

    a = build_parser().parse_args(["serve", "--kv-transport", "nixl", "--kv-channel", "curve", "--log-level",
                                   "debug", "--test-faults", "no_scrub", "--threads", "3"])
    for spec in worker_specs(a, cores=4):
        assert spec.transport == TransportConfig(kv_transport="nixl", kv_channel="curve")
        assert spec.process == ProcessConfig(log_level="debug", test_faults="no_scrub")
        assert spec.worker == WorkerConfig(threads=3)  # its sockets: loopback, the port launch.Fleet picks


@pytest.mark.parametrize("command", ["router", "serve"])
def test_the_router_runs_with_the_timeouts_of_its_flags(command: str) -> None:
    workers = ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"] if command == "router" else []
    a = build_parser().parse_args([command, *workers, "--startup-timeout", "7", "--handoff-timeout", "9",
                                   "--stall-timeout", "4", "--renew-every", "2", "--fleet-port", "7100",
                                   "--ledger", "off"])
    backend = router_backend(a, ServerConfig(), ["tcp://127.0.0.1:1"], ["tcp://127.0.0.1:2"], None)
    assert backend.startup_timeout_s == 7.0
    assert backend.timeouts == HandoffTimeouts(handoff_s=9.0, stall_s=4.0, renew_every_s=2.0)
    assert backend.fleet_bind == "tcp://127.0.0.1:7100"
    if command == "router":
        assert config_from_args(RouterConfig, a).prefill == ("127.0.0.1:1",)  # repeatable: a tuple in the config
    defaults = router_backend(build_parser().parse_args([command, "--ledger", "off"]), ServerConfig(), [], [], None)
    assert (defaults.startup_timeout_s, defaults.timeouts) == (300.0, HandoffTimeouts())


@pytest.mark.parametrize(("argv", "named"), [
    (["decode", "--kv-port", "70000"], "invalid kv_port=70000: give a TCP port"),
    (["decode", "--reservation-timeout", "0"], "invalid reservation_timeout_s=0.0: give a positive number"),
    (["prefill", "--drain-timeout", "-5"], "invalid drain_timeout_s=-5.0: give the seconds"),
    (["prefill", "--metrics-port", "-2"], "invalid metrics_port=-2: give a TCP port -1-65535"),
    (["router", "--prefill", "x:1", "--decode", "y:2", "--startup-timeout", "0"], "invalid startup_timeout_s=0.0"),
    (["router", "--prefill", "x:1", "--decode", "y:2", "--stall-timeout", "-1"], "invalid stall_s=-1.0"),
    (["serve", "--renew-every", "0"], "invalid renew_every_s=0.0"),
    (["serve", "--prefill", "0"], "invalid prefill=0: give at least 1 prefill worker"),
    (["serve", "--fleet-port", "65536"], "invalid fleet_port=65536"),
])
def test_a_bad_setting_exits_2_naming_the_field_the_value_and_the_fix_before_anything_starts(
        argv: list[str], named: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*_: object, **__: object) -> None:
        raise AssertionError("a worker, the fleet or the router started with a bad setting")

    monkeypatch.setattr("kvseal.worker.run.run_worker", started)
    monkeypatch.setattr("kvseal.launch.Fleet", started)
    monkeypatch.setattr("kvseal.cli.router.router_backend", started)
    assert main([*argv, "--ledger", "off"]) == 2
    assert named in capsys.readouterr().err

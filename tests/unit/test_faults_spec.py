"""Test faults (finding 5 of issue 10): the spec is parsed strictly, the product runs the no-op hooks unless
--test-faults names faults, and faults changed at run time come only from the fault file (no wire message)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvseal.faults import parse
from kvseal.wire import protocol as P


@pytest.mark.parametrize(("spec", "why"), [
    ("flip_bytes", "unknown fault 'flip_bytes'"),
    ("stall_transfer=nan", "not a finite number"),
    ("stall_transfer=inf", "not a finite number"),
    ("stall_transfer=-1", "not a finite number"),
    ("stall_transfer=", "needs a value"),
    ("stall_transfer", "needs a value"),
    ("prefill_reject_over=ten", "not a whole number"),
    ("prefill_reject_over=-3", "not a whole number"),
    ("flip_byte=1", "takes no value"),
    ("flip_byte,flip_byte", "given twice"),
    ("control", "unknown fault 'control'"),
])
def test_a_bad_spec_refuses_to_start(spec: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse(spec)


def test_the_cli_refuses_a_bad_spec_before_loading_anything(capsys: pytest.CaptureFixture[str]) -> None:
    from kvseal.cli import main

    assert main(["prefill", "--test-faults", "stall_transfer=nan"]) == 2
    assert "stall_transfer='nan' is not a finite number" in capsys.readouterr().err


def test_canonical_spec_and_no_faults_means_the_product_hooks() -> None:
    from kvseal.faults import hooks_from_spec
    from kvseal.hooks import NO_FAULTS

    assert parse(" wrong_nonce , stall_transfer=2.50,flip_byte ").canonical() == \
        "flip_byte,stall_transfer=2.5,wrong_nonce"
    assert hooks_from_spec(None, "t") is NO_FAULTS and hooks_from_spec("", "t") is NO_FAULTS
    assert NO_FAULTS.spec == NO_FAULTS.active == "" and NO_FAULTS.verify_kv() and NO_FAULTS.capacity_check()


def test_runtime_faults_come_from_the_file_only_and_stay_strict(tmp_path: Path) -> None:
    from kvseal.faults import InjectedFaults, hooks_from_spec

    path = tmp_path / "faults"
    hooks = hooks_from_spec(f"file={path}", "t")
    assert isinstance(hooks, InjectedFaults)
    assert hooks.spec == hooks.active == f"file={path}" and hooks.hold_handoff_s() == 0.0
    path.write_text("stall_transfer=3,prefill_reject_over=10")
    hooks._next_check = 0.0
    hooks.refresh()
    assert hooks.active == f"file={path},prefill_reject_over=10,stall_transfer=3"
    assert hooks.spec == f"file={path}"  # what the fleet check compares does not change at run time
    path.write_text("incident")  # acts only at start: refused, the previous faults stay
    os.utime(path, ns=(1, 1))
    hooks._next_check = 0.0
    hooks.refresh()
    assert hooks.active.endswith("stall_transfer=3")
    path.unlink()
    hooks._next_check = 0.0
    hooks.refresh()
    assert hooks.active == f"file={path}"


def test_the_wire_protocol_carries_no_test_only_message() -> None:
    kinds = {t.__name__ for t in P.Message.__args__}  # type: ignore[attr-defined]
    assert not any("fault" in k.lower() for k in kinds), kinds

"""The seals' mutation proofs (scripts/prove_seals.py) cannot go stale: every snippet still matches its file exactly
once and every test it names exists (issue 17: two of 27 snippets no longer existed and nothing ran the script),
every seal has a proof, and the runner mutates only a copy of the tree. tests/integration/test_seal_proofs.py runs
every mutation."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from tests.helpers.prove import prove_seals

prove = prove_seals()


def test_every_snippet_and_named_test_still_matches_the_code() -> None:
    assert prove.stale(prove.MUTATIONS) == []


def test_every_seal_has_a_mutation_proof() -> None:
    covered = {int(n) for seal, *_ in prove.MUTATIONS for n in re.findall(r"\d+", seal.split(" ")[0])}
    assert covered >= set(range(1, 12)), sorted(covered)


def test_a_stale_entry_is_named() -> None:
    entry = ("6 freed pages are empty", "kvseal/engine/engine.py", "scrubber=self.pool.scrub if cfg", "x",
             ["tests/unit/test_engine.py::test_no_such_test"], False)
    problems = prove.stale([entry])
    assert any("found 0 times in kvseal/engine/engine.py" in p for p in problems), problems
    assert any("test_no_such_test is not in tests/unit/test_engine.py" in p for p in problems), problems


def test_a_mutation_runs_in_a_copy_and_a_surviving_one_is_reported(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the runner makes its copies
    root = tmp_path / "tree"
    (root / "pkg").mkdir(parents=True)
    source = "def answer() -> int:\n    return 42  # the answer\n"
    (root / "pkg" / "mod.py").write_text(source)
    (root / "test_mod.py").write_text("from pkg.mod import answer\n\n\ndef test_answer() -> None:\n"
                                      "    assert answer() == 42\n")
    caught = prove.run_one(("x", "pkg/mod.py", "return 42", "return 41", ["test_mod.py"], False), root)
    survived = prove.run_one(("y", "pkg/mod.py", "# the answer", "# another", ["test_mod.py"], False), root)
    broken = prove.run_one(("z", "pkg/mod.py", "return 42", "return (", ["test_mod.py"], False), root)
    assert (caught.verdict, survived.verdict) == ("caught", "SURVIVED"), (caught, survived)
    assert broken.verdict == "SURVIVED" and "not a test failure" in broken.detail  # a collection error proves nothing
    assert (root / "pkg" / "mod.py").read_text() == source  # the tree itself was never touched
    assert not list(temp.iterdir())  # the copies are gone


def test_every_test_the_seals_register_names_exists() -> None:
    """docs/seals.md's register (seal 11) names a test for each shared resource: each must exist, so the register
    cannot point at a test that was renamed or removed."""
    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "seals.md").read_text()
    named = re.findall(r"`(tests/[\w/]+\.py)((?:::\w+)?)`((?:, `::\w+`)*)", text)
    assert len(named) >= 20, named
    for path, first, more in named:
        source = (root / path).read_text()
        for name in [first, *re.findall(r"::\w+", more)]:
            if name:
                assert f"def {name[2:]}(" in source, f"docs/seals.md names {path}{name}, which does not exist"

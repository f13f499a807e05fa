"""Every seal's mutation proof runs in `make test`: each entry of scripts/prove_seals.py breaks its snippet in a
copy of the tree and its tests (the smallest selection that catches it) must fail there. Some start real processes,
so this is the suite's one long test: it prints each mutation's time and the total."""

from __future__ import annotations

import time

import pytest

from tests.helpers.prove import prove_seals

pytestmark = [pytest.mark.integration, pytest.mark.e2e]


def test_every_seal_mutation_is_caught_by_its_tests() -> None:
    prove = prove_seals()
    start = time.monotonic()
    results = prove.run(prove.MUTATIONS, jobs=2)
    print(f"{len(results)} mutations in {time.monotonic() - start:.0f}s")
    assert [(r.seal, r.verdict, r.detail) for r in results if r.verdict != "caught"] == []

"""Shared real-model fixtures: the bundled checkpoint is loaded once per test session."""

from __future__ import annotations

import pytest

from kvseal.model.checkpoint import Checkpoint
from kvseal.model.loader import load_checkpoint


@pytest.fixture(scope="session")
def smol() -> Checkpoint:
    return load_checkpoint(None, progress=False)

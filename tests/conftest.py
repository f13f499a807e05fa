from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest

from kvseal.model.checkpoint import Checkpoint


@pytest.fixture(scope="session")
def smol() -> Checkpoint:
    """The bundled SmolLM2-135M-Instruct, loaded once per test session."""
    from kvseal.model.loader import load_checkpoint

    return load_checkpoint(None, progress=False)

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402

from kvseal.model.checkpoint import Checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def smol() -> Checkpoint:
    """The bundled SmolLM2-135M-Instruct, loaded once per test session."""
    from kvseal.model.loader import load_checkpoint

    return load_checkpoint(None, progress=False)

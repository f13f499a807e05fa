from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `kvseal serve` keeps a forensic ledger by default: the servers tests start keep theirs in a temp folder
os.environ.setdefault("KVSEAL_DATA_DIR", tempfile.mkdtemp(prefix="kvseal-test-data-"))
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest

from kvseal.model.checkpoint import Checkpoint


@pytest.fixture(scope="session")
def smol() -> Checkpoint:
    """The bundled SmolLM2-135M-Instruct, loaded once per test session."""
    from kvseal.model.loader import load_checkpoint

    return load_checkpoint(None, progress=False)

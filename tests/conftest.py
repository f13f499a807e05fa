from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `kvseal serve` keeps a forensic ledger by default: the servers tests start keep theirs in a temp folder
os.environ.setdefault("KVSEAL_DATA_DIR", tempfile.mkdtemp(prefix="kvseal-test-data-"))
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the weights caches (model/weight_cache.py) the tests build go to a folder of their own, removed at the end
if "KVSEAL_WEIGHTS_CACHE_DIR" not in os.environ:
    os.environ["KVSEAL_WEIGHTS_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvseal-test-weights-")
_WEIGHTS = os.environ["KVSEAL_WEIGHTS_CACHE_DIR"]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import shutil
from collections.abc import Iterator

import pytest

from kvseal.model.checkpoint import Checkpoint


def pytest_collection_finish(session: pytest.Session) -> None:
    """The container test's image builds in the background while the tests before it run."""
    if any(item.nodeid.startswith("tests/integration/test_container.py") for item in session.items) and \
            shutil.which("podman"):
        from tests.helpers import image_build

        image_build.start()


@pytest.fixture(scope="session", autouse=True)
def _remove_weights_caches() -> Iterator[None]:
    yield
    if os.path.basename(_WEIGHTS).startswith("kvseal-test-weights-"):
        shutil.rmtree(_WEIGHTS, ignore_errors=True)


@pytest.fixture(scope="session")
def smol() -> Checkpoint:
    """The bundled SmolLM2-135M-Instruct, loaded once per test session."""
    from kvseal.model.loader import load_checkpoint

    return load_checkpoint(None, progress=False)

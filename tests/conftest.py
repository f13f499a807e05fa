from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The servers tests start keep their forensic ledger (`kvseal serve` keeps one by default) and the weights caches
# they build (model/weight_cache.py) in temp folders of this test process, removed at its end. Each pytest-xdist
# worker makes its own: a worker inherits the folders of the process that started it, and whichever finished
# first would remove them under the other. A pytest that a test starts (scripts/prove_seals.py's) shares its
# parent's, caches included; a user's own KVSEAL_DATA_DIR / KVSEAL_WEIGHTS_CACHE_DIR is kept.
_TEMP = {"KVSEAL_DATA_DIR": "kvseal-test-data-", "KVSEAL_WEIGHTS_CACHE_DIR": "kvseal-test-weights-"}
_OWN: list[str] = []
for _var, _prefix in _TEMP.items():
    _mine = _prefix + os.environ.get("PYTEST_XDIST_WORKER", "main") + "-"
    _given = os.path.basename(os.environ.get(_var, _prefix))
    if _given == _prefix or (_given.startswith(_prefix) and not _given.startswith(_mine)):
        os.environ[_var] = tempfile.mkdtemp(prefix=_mine)
        _OWN.append(os.environ[_var])


import shutil

import pytest
from hypothesis import Phase, settings

# scripts/prove_seals.py runs a seal's tests against a broken copy of the code, where they must fail: the first
# failing example proves it, so hypothesis does not shrink it there (shrinking took a minute of a mutation's run)
settings.register_profile("prove_seals", phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target])
if os.environ.get("KVSEAL_PROVE_SEALS"):
    settings.load_profile("prove_seals")

from kvseal.model.checkpoint import Checkpoint


def pytest_collection_finish(session: pytest.Session) -> None:
    """The container test's image builds in the background while the tests before it run."""
    if any(item.nodeid.startswith("tests/integration/test_container.py") for item in session.items) and \
            shutil.which("podman"):
        from tests.helpers import image_build

        image_build.start()


# The longest files (minutes each on 2 cores). On parallel workers (scripts/test.sh: pytest-xdist, whole files to a
# worker, handed out in collection order) they start first, so that no worker is left with one of them at the end.
LONG_FIRST = ("tests/integration/test_seal_proofs.py", "tests/e2e/test_audit_incident.py",
              "tests/e2e/test_correctness.py", "tests/e2e/test_real_qwen.py", "tests/integration/test_soak.py",
              "tests/integration/test_faults.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("numprocesses", None) or os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {path: i for i, path in enumerate(LONG_FIRST)}
        items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(LONG_FIRST)))  # stable: else as is


def pytest_sessionfinish(session: pytest.Session) -> None:
    for folder in _OWN:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def smol() -> Checkpoint:
    """The bundled SmolLM2-135M-Instruct, loaded once per test session."""
    from kvseal.model.loader import load_checkpoint

    return load_checkpoint(None, progress=False)

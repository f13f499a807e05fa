"""The real GGUF models of scripts/fetch_models.py (setup fetches the 0.5B; `make models` the others): found in
~/.cache/kvseal/models, or fetched now through the same script."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fetch_models.py"


def _fetcher() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvseal_fetch_models", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def real_model(name: str) -> str:
    """The path of `name` (e.g. "qwen2.5-coder-0.5b"), checked against its recorded size and sha256."""
    return str(_fetcher().fetch(name))

"""The bundled SmolLM2 GGUF, loaded once per test process by kvseal and by transformers.

transformers' loading costs seconds (gguf-py's GGUFReader alone parses ~98k tokenizer strings), so one
read-only reader and each loader's result are memoized here and shared by every test module in the process.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import gguf

from kvseal.model.checkpoint import Checkpoint
from kvseal.model.gguf import load_gguf
from kvseal.model.gguf_file import GGUFFile
from kvseal.model.gguf_tokenizer import tokenizer_from_gguf_reader
from kvseal.model.locate import DEFAULT_MODEL_NAME, default_model_path
from kvseal.model.tokenizer import Tokenizer


@functools.lru_cache(maxsize=1)
def bundled_tokenizer() -> Tokenizer:
    return tokenizer_from_gguf_reader(GGUFFile(default_model_path()))


@functools.lru_cache(maxsize=1)
def bundled_checkpoint() -> Checkpoint:
    """kvseal's load of the bundled model (shared; tests must not mutate it)."""
    ckpt = load_gguf(default_model_path(), progress=False)
    ckpt.name = DEFAULT_MODEL_NAME
    return ckpt


_ORIGINAL_READER = gguf.GGUFReader


@functools.lru_cache(maxsize=4)
def _cached_reader(path: str, mode: Literal["r", "r+", "c"]) -> gguf.GGUFReader:
    return _ORIGINAL_READER(path, mode)


@contextlib.contextmanager
def fast_transformers_gguf() -> Iterator[None]:
    """Speed up transformers' GGUF loading without changing what it computes.

    transformers builds a fresh GGUFReader for the config, the tokenizer and the weights (seconds
    each), and calls gguf.get_tensor_name_map once per submodule (~400 times). Both are pure
    functions of their arguments, so memoizing them returns the same objects transformers would
    have built. Only active inside this block; kvseal's own loader never runs under it.
    """
    original_map = gguf.get_tensor_name_map
    gguf.GGUFReader = lambda path, mode="r": _cached_reader(os.path.realpath(path), mode)  # type: ignore[assignment,misc]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_map)  # type: ignore[assignment]
    try:
        yield
    finally:
        gguf.GGUFReader = _ORIGINAL_READER  # type: ignore[misc]
        gguf.get_tensor_name_map = original_map  # type: ignore[assignment]


@functools.lru_cache(maxsize=1)
def transformers_gguf_tokenizer() -> Any:
    """transformers.AutoTokenizer.from_pretrained(dir, gguf_file=...) for the bundled model (shared)."""
    from transformers import AutoTokenizer

    path = Path(default_model_path())
    with fast_transformers_gguf():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def transformers_gguf_model() -> Any:
    """A fresh float32 transformers model loaded from the bundled GGUF (not memoized: ~0.5 GB)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(default_model_path())
    with fast_transformers_gguf():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)

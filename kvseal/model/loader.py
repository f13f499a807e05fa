"""One entry point for every checkpoint format, and where the bundled default model lives."""

from __future__ import annotations

from pathlib import Path

from kvseal.model.checkpoint import Checkpoint
from kvseal.model.gguf import load_gguf
from kvseal.model.locate import DEFAULT_MODEL_NAME, default_model_path
from kvseal.model.safetensors import load_hf_folder


def load_checkpoint(path: str | None, progress: bool = True) -> Checkpoint:
    """Load a .gguf file, a HF folder (config.json + safetensors), or a folder holding exactly one .gguf.

    None loads the bundled default model.
    """
    if path is None:
        ckpt = load_gguf(default_model_path(), progress=progress)
        ckpt.name = DEFAULT_MODEL_NAME
        return ckpt
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {path!r} does not exist")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(
                f"model path {path!r} is a file but not a .gguf; pass a .gguf file or a Hugging Face model folder"
            )
        return load_gguf(str(p), progress=progress)
    if (p / "config.json").is_file():
        return load_hf_folder(str(p), progress=progress)
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return load_gguf(str(ggufs[0]), progress=progress)
    if ggufs:
        names = ", ".join(g.name for g in ggufs)
        raise ValueError(f"folder {path!r} holds several .gguf files ({names}); pass the one to load")
    raise ValueError(
        f"folder {path!r} has neither config.json (a Hugging Face model) nor a .gguf file; cannot load a model"
    )

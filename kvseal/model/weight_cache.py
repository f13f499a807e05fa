"""The weights cache: matrices derived from a GGUF file (fused, rows reordered, repacked for the fast arithmetic),
written once into `<weights cache>/<content key>-<form>-<version>.bin` and mapped read-only by every process that
loads the same file, so the workers of one host share its pages through the page cache.

File layout: blobs (64-byte aligned) | header (JSON) | footer (64 bytes: magic b"KVSWCACH", format version u32,
header offset u64, header length u64, sha256 of the header, padding).
The header maps each entry name to its value: an int/float/str/bool/None as is, {"tensor": [offset, nbytes,
dtype, shape]}, {"tuple": [...]}, or {"dataclass": name, "fields": {...}} for a dataclass of kvseal.kernels.weights
(PackedWeight, QWeight, and whatever the kernels add: its fields travel as they are).

Opening checks the size, magic, version, header checksum, key and that every blob lies inside the file; a file
that fails (short, torn, foreign, older format) is rebuilt. Blob bytes are not checksummed (that would read the
whole file at every start): a build writes them, fdatasyncs, and only then renames the file into place, under an
exclusive lock that a second process starting at the same time waits on and then maps the result.
A build pwrites into a sparse temporary file (blocks reserved with posix_fallocate first, so a full disk is an
error here and not a SIGBUS later) and reads it back through a read-only shared map: no process ever maps the
cache writable. A valid file is mapped with MAP_POPULATE: when the model is built its weights are resident
(read from disk if they were not in the page cache), so the first request does not wait on page faults.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import mmap
import os
import struct
import warnings
from pathlib import Path
from typing import Any

import torch

from kvseal.model.file_index import file_lock

FORMAT_VERSION = 1
_MAGIC = b"KVSWCACH"
_FOOTER = struct.Struct("<8sIQQ32s4x")  # 64 bytes
_ALIGN = 64
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: read the whole file in when mapping it
_DTYPES = {str(d): d for d in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                                torch.bfloat16, torch.float32, torch.float64)}

log = logging.getLogger("kvseal.model")


class CacheInvalid(ValueError):
    pass


def _frombuffer(m: mmap.mmap, offset: int, nbytes: int) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=offset)


class _Reader:
    """A valid cache file mapped read-only."""

    def __init__(self, path: Path, key: str) -> None:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _FOOTER.size:
                raise CacheInvalid(f"{size} bytes, shorter than its footer")
            self.map = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
        magic, version, h_off, h_len, digest = _FOOTER.unpack_from(self.map, size - _FOOTER.size)
        if magic != _MAGIC:
            raise CacheInvalid("no footer (a torn or foreign file)")
        if version != FORMAT_VERSION:
            raise CacheInvalid(f"format version {version}, this kvseal writes {FORMAT_VERSION}")
        if h_off + h_len + _FOOTER.size != size:
            raise CacheInvalid(f"header at {h_off}+{h_len} does not end where the footer starts ({size} bytes)")
        header = self.map[h_off : h_off + h_len]
        if hashlib.sha256(header).digest() != digest:
            raise CacheInvalid("header checksum mismatch")
        meta = json.loads(header)
        if meta.get("key") != key:
            raise CacheInvalid(f"key {meta.get('key')!r} is not {key!r}")
        self.entries: dict[str, Any] = meta["entries"]
        self.data_end = h_off
        self._check(self.entries)

    def _check(self, v: Any) -> None:
        if isinstance(v, dict) and "tensor" in v:
            off, nbytes, dtype, _ = v["tensor"]
            if off < 0 or off + nbytes > self.data_end or dtype not in _DTYPES:
                raise CacheInvalid(f"blob {v['tensor']} outside the data ({self.data_end} bytes) or of unknown type")
        elif isinstance(v, dict):
            for x in v.values():
                self._check(x)
        elif isinstance(v, list):
            for x in v:
                self._check(x)

    def value(self, v: Any) -> Any:
        from kvseal.kernels import weights

        if isinstance(v, dict) and "tensor" in v:
            off, nbytes, dtype, shape = v["tensor"]
            return _frombuffer(self.map, off, nbytes).view(_DTYPES[dtype]).view(shape)
        if isinstance(v, dict) and "tuple" in v:
            return tuple(self.value(x) for x in v["tuple"])
        if isinstance(v, dict) and "dataclass" in v:
            cls: Any = getattr(weights, v["dataclass"], None)
            if cls is None or not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
                raise CacheInvalid(f"kvseal.kernels.weights has no dataclass {v['dataclass']!r}")
            return cls(**{k: self.value(x) for k, x in v["fields"].items()})
        return v


class _Writer:
    """A cache being built: a sparse temporary file reserved up to `reserve` bytes, written with pwrite (no page
    faults, nothing counted in this process's RSS) and read back through a read-only shared map of it."""

    def __init__(self, path: Path, key: str, reserve: int) -> None:
        self.path, self.key = path, key
        self.tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, reserve)
        self.map = mmap.mmap(self.fd, reserve, access=mmap.ACCESS_READ)
        self.reserve, self.used = reserve, 0
        self.entries: dict[str, Any] = {}

    def _tensor(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if str(t.dtype) not in _DTYPES or t.device.type != "cpu":
            raise TypeError(f"cannot cache a {t.dtype} tensor on {t.device}")
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        nbytes = flat.numel()
        off = (self.used + _ALIGN - 1) // _ALIGN * _ALIGN
        if off + nbytes > self.reserve:
            raise OSError(f"the reservation of {self.reserve} bytes is exhausted")
        if nbytes:
            os.posix_fallocate(self.fd, off, nbytes)  # ENOSPC here, not SIGBUS on a page fault later
            buf, done = flat.numpy().data, 0
            while done < nbytes:
                done += os.pwrite(self.fd, buf[done:], off + done)
        self.used = off + nbytes
        view = _frombuffer(self.map, off, nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        return view.view(t.dtype).view(t.shape), {"tensor": [off, nbytes, str(t.dtype), list(t.shape)]}

    def store(self, v: Any) -> tuple[Any, Any]:
        """(the value with its tensors moved into the file, its header form)."""
        if isinstance(v, torch.Tensor):
            return self._tensor(v)
        if isinstance(v, tuple):
            pairs = [self.store(x) for x in v]
            return tuple(p[0] for p in pairs), {"tuple": [p[1] for p in pairs]}
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            name = type(v).__name__
            from kvseal.kernels import weights

            if getattr(weights, name, None) is not type(v):
                raise TypeError(f"cannot cache a {type(v).__qualname__}: only dataclasses of kvseal.kernels.weights")
            fields = {f.name: self.store(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init}
            return type(v)(**{k: p[0] for k, p in fields.items()}), {
                "dataclass": name, "fields": {k: p[1] for k, p in fields.items()}}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v, v
        raise TypeError(f"cannot cache a {type(v).__qualname__}")

    def publish(self) -> None:
        header = json.dumps({"key": self.key, "entries": self.entries}).encode()
        h_off = (self.used + _ALIGN - 1) // _ALIGN * _ALIGN
        footer = _FOOTER.pack(_MAGIC, FORMAT_VERSION, h_off, len(header), hashlib.sha256(header).digest())
        os.ftruncate(self.fd, h_off + len(header) + _FOOTER.size)  # map pages past it are never touched
        os.pwrite(self.fd, header + footer, h_off)
        os.fdatasync(self.fd)
        os.replace(self.tmp, self.path)
        os.close(self.fd)

    def discard(self) -> None:
        """Give up on the file; values already stored stay valid (the map outlives the unlinked file)."""
        os.close(self.fd)
        self.tmp.unlink(missing_ok=True)


class WeightCache:
    """Derived weights by name, from a valid cache file, or built into a new one (under its lock) and published
    by `finish`. Without a file (the folder is not writable, the disk is full) values stay in memory."""

    def __init__(self, folder: Path, stem: str, key: str, reserve: int) -> None:
        self.path = folder / f"{stem}.bin"
        self._reader: _Reader | None = None
        self._writer: _Writer | None = None
        self._lock: Any = None
        self.misses = 0
        self.built = False
        reason = self._open_reader(key)
        if self._reader is not None:
            return
        self._lock = file_lock(self.path.with_name(self.path.name + ".lock"))
        self._lock.__enter__()
        if self._open_reader(key) is None and self._reader is not None:  # built by another process meanwhile
            self._unlock()
            return
        if reason != "absent":
            log.warning("weights cache %s is invalid (%s); rebuilding it", self.path, reason)
        try:
            self._writer = _Writer(self.path, key, reserve)
        except OSError as e:
            log.warning("cannot create the weights cache %s (%s); keeping the weights in memory", self.path, e)
            self._unlock()

    def _open_reader(self, key: str) -> str | None:
        """None when a valid file was opened, else why not."""
        if not self.path.is_file():
            return "absent"
        try:
            self._reader = _Reader(self.path, key)
            return None
        except (CacheInvalid, OSError, ValueError, KeyError, TypeError) as e:
            return str(e)

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None

    @property
    def building(self) -> bool:
        return self._writer is not None

    @property
    def in_use(self) -> bool:
        """The weights come from the file: mapped from a valid one, or built and published by this process."""
        return self._reader is not None or self.built

    def lookup(self, name: str) -> Any | None:
        if self._reader is None or name not in self._reader.entries:
            return None
        return self._reader.value(self._reader.entries[name])

    def store(self, name: str, value: Any) -> Any:
        """Build mode: the value with its tensors in the file. Otherwise (a read cache that lacks it, no file):
        the value as it is, in memory."""
        if self._writer is None:
            self.misses += self._reader is not None
            return value
        try:
            stored, form = self._writer.store(value)
        except OSError as e:
            log.warning("weights cache %s: %s; keeping the rest of the weights in memory", self.path, e)
            self.discard()
            return value
        self._writer.entries[name] = form
        return stored

    def finish(self) -> None:
        if self._writer is not None and not self._writer.entries:  # nothing derived: no file to map
            self.discard()
        elif self._writer is not None:
            self._writer.publish()
            self._writer, self.built = None, True
            for old in self.path.parent.glob(self.path.name.rsplit("-", 1)[0] + "-*.bin"):
                if old != self.path:  # the same weights for another kernels version
                    old.unlink(missing_ok=True)
        elif self._reader is not None and self.misses:
            log.warning("weights cache %s lacked %d weights (kept in memory); it is removed and rebuilt at the "
                        "next start", self.path, self.misses)
            self.path.unlink(missing_ok=True)
        self._unlock()

    def discard(self) -> None:
        if self._writer is not None:
            self._writer.discard()
            self._writer = None
        self._unlock()

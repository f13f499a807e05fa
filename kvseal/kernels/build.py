"""Compile kvseal's C kernels (cpu_kernels.c, dequant.c, qpack.c, qgemm.c, qunpack.c, qamx.c, peak.c,
attention.c, forward.c, and the headers they include) once per source version, load them with ctypes.

The shared library lands in $KVSEAL_CACHE_DIR (default ~/.cache/kvseal, or a per-user temp folder where that
is not writable) under a name that carries the hash of
the source and flags, so an edited source is rebuilt and two processes starting together never load a
half-written file (each compiles to a temporary name and renames it into place).
`python -m kvseal.kernels.build` builds it ahead of time (the setup script does).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Protocol

SOURCES = tuple(Path(__file__).with_name(n) for n in ("cpu_kernels.c", "dequant.c", "qpack.c", "qgemm.c", "qunpack.c",
                                                     "qvec.c", "qamx.c", "peak.c", "attention.c", "forward.c"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("kvs.h", "qgemm.h", "qtile.h"))
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-D_ISOC11_SOURCE")
CPU_FLAGS = ("avx2", "fma", "f16c")


class ArchShape(Protocol):
    """What the kernels ask of a model's architecture (model/arch.py's ModelArch): the shapes they must divide."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str  # why not, when not ok ("" when ok)


def cpu_supports() -> Availability:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError as e:
        return Availability(False, f"cannot read /proc/cpuinfo ({e})")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    missing = [f for f in CPU_FLAGS if f not in flags]
    if missing:
        return Availability(False, f"this CPU lacks {', '.join(missing)}")
    return Availability(True, "")


def compiler() -> str | None:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cache_root() -> Path:
    """$KVSEAL_CACHE_DIR, else ~/.cache/kvseal, else a per-user folder in the temp dir: the first writable one."""
    env = os.environ.get("KVSEAL_CACHE_DIR")
    candidates = [Path(env)] if env else []
    if not env:
        try:
            candidates.append(Path.home() / ".cache" / "kvseal")
        except RuntimeError:  # no HOME and no passwd entry
            pass
        candidates.append(Path(tempfile.gettempdir()) / f"kvseal-{os.getuid()}")
    for root in candidates:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(root, os.W_OK):
            return root
    raise RuntimeError(f"no writable folder for the compiled kernels (tried {', '.join(map(str, candidates))}); "
                       "set KVSEAL_CACHE_DIR")


def library_path() -> Path:
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS)
                            + " ".join(FLAGS).encode()).hexdigest()[:16]
    return _cache_root() / f"libkvseal_cpu_{digest}.so"


def build(verbose: bool = False) -> Path:
    """The compiled library's path, compiling it first when needed. RuntimeError names what failed."""
    lib = library_path()
    if lib.is_file():
        return lib
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (looked for $CC, cc, gcc, clang); install gcc or use --kernels torch")
    fd, tmp = tempfile.mkstemp(prefix=lib.name + ".", suffix=".tmp", dir=lib.parent)
    os.close(fd)
    cmd = [cc, *FLAGS, "-o", tmp, *map(str, SOURCES)]
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"compiling {', '.join(s.name for s in SOURCES)} failed ({' '.join(cmd)}):\n"
                           f"{proc.stderr.strip()}")
    os.replace(tmp, lib)
    return lib


@cache
def load() -> ctypes.CDLL:
    """Load the library (building it when needed), with argument types declared for every entry point."""
    import torch  # noqa: F401  # torch's libgomp must be loaded first so the kernels share its thread pool

    lib = ctypes.CDLL(str(build()))
    i32, i64, ptr, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.kvs_row_bytes.argtypes, lib.kvs_row_bytes.restype = [i32, i64], i64
    lib.kvs_gemm.argtypes, lib.kvs_gemm.restype = [i32, ptr, i64, i64, ptr, i64, ptr], i32
    lib.kvs_dequant.argtypes, lib.kvs_dequant.restype = [i32, ptr, i64, i64, ptr], i32
    lib.kvs_dequant_rows.argtypes, lib.kvs_dequant_rows.restype = [i32, ptr, i64, i64, ptr, i64, ptr], i32
    lib.kvs_paged_decode.argtypes = [ptr, ptr, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, f32, ptr]
    lib.kvs_paged_decode.restype = i32
    lib.kvs_rmsnorm.argtypes, lib.kvs_rmsnorm.restype = [ptr, ptr, i64, i64, f32, ptr], i32
    lib.kvs_rope.argtypes, lib.kvs_rope.restype = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, i64], i32
    lib.kvs_silu_mul.argtypes, lib.kvs_silu_mul.restype = [ptr, i64, i64, ptr], i32
    lib.kvs_decode_forward.argtypes = [ptr, i64, i64, i64, i64, i64, i64, f32, f32, ptr, ptr, i64, ptr, ptr, i64,
                                       i64, i64, ptr, ptr, ptr, ptr, i64, ptr]
    lib.kvs_decode_forward.restype = i32
    lib.kvs_qpacked_bytes.argtypes, lib.kvs_qpacked_bytes.restype = [i32, i64, i64], i64
    lib.kvs_qpack.argtypes, lib.kvs_qpack.restype = [i32, ptr, i64, i64, ptr], i32
    lib.kvs_qlinear.argtypes, lib.kvs_qlinear.restype = [i32, ptr, i64, i64, ptr, i64, ptr], i32
    lib.kvs_qlinear_mat.argtypes, lib.kvs_qlinear_mat.restype = [ptr, i64, ptr, i64, ptr, ptr], i32
    lib.kvs_qscratch_bytes.argtypes, lib.kvs_qscratch_bytes.restype = [i64, i64], i64
    lib.kvs_gemm_mat.argtypes, lib.kvs_gemm_mat.restype = [ptr, i64, ptr, i64, ptr], i32
    lib.kvs_qisa.argtypes, lib.kvs_qisa.restype = [], i32
    lib.kvs_qisa_have.argtypes, lib.kvs_qisa_have.restype = [], i32
    lib.kvs_qisa_pick.argtypes, lib.kvs_qisa_pick.restype = [i32, i32], i32
    lib.kvs_qisa_refused.argtypes, lib.kvs_qisa_refused.restype = [], i32
    lib.kvs_paged_attention.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i32, i64, i64, ptr, i64, ptr, i64, f32,
                                        ptr]
    lib.kvs_paged_attention.restype = i32
    lib.kvs_write_kv.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, i32, i64, i64, ptr]
    lib.kvs_write_kv.restype = i32
    lib.kvs_forward_fast.argtypes = [ptr, i64, i64, i64, i64, i64, i64, f32, f32, ptr, ptr, i64, ptr, ptr, i32, i64,
                                     i64, i64, ptr, ptr, ptr, ptr, i64, ptr, i64]
    lib.kvs_forward_fast.restype = i32
    lib.kvs_set_threads.argtypes, lib.kvs_set_threads.restype = [i32], None
    lib.kvs_get_threads.argtypes, lib.kvs_get_threads.restype = [], i32
    lib.kvs_peak_issue.argtypes, lib.kvs_peak_issue.restype = [i32, i64], i64
    return lib


def resolve(requested: str, device: str, dtype: str, arch: ArchShape) -> tuple[str, str]:
    """("native" | "torch", why) for --kernels `requested` on this device and dtype, for this model.

    native needs the CPU, float32, a head_dim that is a multiple of 8 up to 256, at most 64 query heads per kv
    head, hidden and intermediate sizes that are multiples of 8, a CPU with AVX2/FMA/F16C and a library that
    builds; an explicit "native" that cannot run is a ValueError naming the reason, "auto" falls back to torch
    and says why.
    """
    head_dim, group = arch.head_dim, arch.num_heads // arch.num_kv_heads
    if requested == "torch":
        return "torch", "--kernels torch"
    reasons = []
    if device != "cpu":
        reasons.append(f"device is {device}, the native kernels are CPU-only")
    if dtype != "float32":
        reasons.append(f"dtype is {dtype}, the native kernels compute in float32")
    if head_dim % 8 or head_dim > 256 or group > 64:
        reasons.append(f"head_dim {head_dim} / group {group}: the attention kernel takes head_dim a multiple of "
                       "8 up to 256 and at most 64 query heads per kv head")
    if arch.hidden_size % 8 or arch.intermediate_size % 8:
        reasons.append(f"hidden {arch.hidden_size} / intermediate {arch.intermediate_size} are not multiples of 8")
    if not reasons:
        avail = cpu_supports()
        if not avail.ok:
            reasons.append(avail.reason)
    if not reasons:
        try:
            load()
        except (RuntimeError, OSError) as e:
            reasons.append(str(e))
    if not reasons:
        return "native", f"--kernels {requested}"
    if requested == "native":
        raise ValueError(f"--kernels native cannot run here: {'; '.join(reasons)}. Fix: use --kernels torch or auto")
    return "torch", f"--kernels auto chose torch: {'; '.join(reasons)}"


def main() -> int:
    avail = cpu_supports()
    if not avail.ok:
        print(f"kvseal kernels: not built: {avail.reason}; kvseal will use --kernels torch", file=sys.stderr)
        return 0
    try:
        print(f"kvseal kernels: {build(verbose=True)}")
    except RuntimeError as e:
        print(f"kvseal kernels: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

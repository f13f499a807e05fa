"""What a benchmark run ran on: the CPU model, the vector ISA flags that decide each server's arithmetic, torch's
CPU capability, the date and the git commit. `record(...)` and `header(...)` are pure; `collect()` reads the
machine (/proc/cpuinfo, torch, git).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

# The flags that pick a kernel path in ggml, oneDNN (vLLM, torch) and kvseal, in /proc/cpuinfo's spelling.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def parse_cpuinfo(text: str) -> tuple[str, set[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo's text; ("unknown", set()) when absent."""
    model, flags = "unknown", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def record(cpuinfo: str, cores: int | None, torch_capability: str | None, commit: str | None,
           date: str) -> dict[str, Any]:
    model, flags = parse_cpuinfo(cpuinfo)
    return {"cpu_model": model, "cores": cores, "isa": {f: f in flags for f in ISA_FLAGS},
            "torch_cpu_capability": torch_capability, "date": date, "git_commit": commit}


def header(rec: dict[str, Any]) -> str:
    """One line for the top of the table: CPU, cores, the ISA flags it has (and that it has no AMX), torch's
    capability, date, commit."""
    isa = rec.get("isa") or {}
    have = [f for f in ISA_FLAGS if isa.get(f)]
    no_amx = [] if any(isa.get(f) for f in ISA_FLAGS if f.startswith("amx")) else ["no AMX"]
    return (f"CPU: {rec.get('cpu_model')}, {rec.get('cores')} cores; {' '.join(have + no_amx) or 'no listed ISA'}; "
            f"torch capability {rec.get('torch_cpu_capability')}; {rec.get('date')}; "
            f"commit {rec.get('git_commit') or 'unknown'}")


def git_commit(repo: Path) -> str | None:
    """HEAD's hash, with "-dirty" when tracked files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def collect() -> dict[str, Any]:
    import os

    import torch

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    return record(cpuinfo, os.cpu_count(), torch.backends.cpu.get_cpu_capability(),
                  git_commit(Path(__file__).resolve().parents[1]), time.strftime("%Y-%m-%d %H:%M:%S %Z"))

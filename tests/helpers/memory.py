"""Where a process's memory comes from, read from /proc: which file backs an address, and how much of a file's
mapping is resident (Rss) and this process's share of it (Pss, pages shared by n processes count 1/n)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch


def weight_tensors(w: Any) -> list[torch.Tensor]:
    """Every tensor inside a model weight, whatever its form: a tensor, GGUF blocks, repacked blocks, parts of
    several (dataclasses and tuples, walked)."""
    if isinstance(w, torch.Tensor):
        return [w]
    if isinstance(w, (tuple, list)):
        return [t for x in w for t in weight_tensors(x)]
    if dataclasses.is_dataclass(w) and not isinstance(w, type):
        return [t for f in dataclasses.fields(w) for t in weight_tensors(getattr(w, f.name))]
    return []


def mapped_file(address: int, pid: int | str = "self") -> str | None:
    """The real path of the file mapped at `address` in process `pid`; None for anonymous memory."""
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                path = fields[5].strip() if len(fields) > 5 else ""
                return os.path.realpath(path) if path.startswith("/") else None
    return None


def file_residency_kb(path: str, pid: int | str = "self") -> tuple[int, int]:
    """(Rss, Pss) in kB of every mapping of `path` in process `pid`."""
    real, rss, pss, inside = os.path.realpath(path), 0, 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                inside = len(head) > 5 and os.path.realpath(head[5]) == real
            elif inside and head[0] == "Rss:":
                rss += int(head[1])
            elif inside and head[0] == "Pss:":
                pss += int(head[1])
    return rss, pss

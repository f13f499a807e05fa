"""The memory a server takes: RSS and PSS summed over its process tree, sampled in a thread from its start to its
stop (a kvseal fleet is a router and workers; vLLM has an engine core process; llama-server is one process).

- peak RSS: the largest sum of the tree's RSS at one sample (every `interval` s). Pages two processes share (a
  mapped weights file) count once per process.
- peak PSS: the same for PSS (each shared page split between the processes that map it): what the tree costs
  the machine. Read from smaps_rollup, so less often (every `pss_every` samples).
- hwm: each process's own high-water mark (VmHWM), summed: an upper bound of the peak RSS that a sample can miss.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import psutil


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _hwm_bytes(p: psutil.Process) -> int:
    with open(f"/proc/{p.pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class TreeMemory:
    def __init__(self, pid: int, interval: float = 0.2, pss_every: int = 5) -> None:
        self.pid, self.interval, self.pss_every = pid, interval, pss_every
        self.peak_rss = self.peak_pss = self.samples = 0
        self.hwm: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)

    def start(self) -> TreeMemory:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        procs = _tree(self.pid)
        rss = pss = 0
        with_pss = self.samples % self.pss_every == 0
        for p in procs:
            with contextlib.suppress(psutil.Error, OSError):
                if with_pss:
                    full = p.memory_full_info()
                    rss, pss = rss + full.rss, pss + full.pss
                else:
                    rss += p.memory_info().rss
                self.hwm[p.pid] = max(self.hwm.get(p.pid, 0), _hwm_bytes(p))
        self.peak_rss = max(self.peak_rss, rss)
        if with_pss:
            self.peak_pss = max(self.peak_pss, pss)
        self.samples += 1

    def stop(self) -> dict[str, Any]:
        """Stop sampling (call before the processes are stopped, so the last sample sees them)."""
        self.sample()
        self._stop.set()
        self._thread.join(timeout=5)
        return {"peak_rss_bytes": self.peak_rss, "peak_pss_bytes": self.peak_pss,
                "hwm_sum_bytes": sum(self.hwm.values()), "processes": len(self.hwm), "samples": self.samples}

"""The container test's image, built while the rest of the suite runs: a cold `make image` (debootstrap, wheels,
podman build) takes minutes, mostly waiting on the mirror and the disk. When the container test is among the
collected tests, the build starts in the background at the end of collection (niced), and the test's fixture waits
for it; run alone, the fixture builds it itself. Either way it is `scripts/image.sh --if-stale`."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_build: tuple[subprocess.Popen[bytes], Path] | None = None


def start() -> None:
    global _build
    if _build is None:
        log = Path(tempfile.mkstemp(prefix="kvseal-image-", suffix=".log")[1])
        with log.open("wb") as out:
            proc = subprocess.Popen(["nice", "-n", "19", "bash", str(ROOT / "scripts" / "image.sh"), "--if-stale"],
                                    stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        _build = (proc, log)


def wait(timeout: float = 1200) -> tuple[int, str]:
    """(exit code, output) of the build, starting it now if nothing started it."""
    start()
    assert _build is not None
    proc, log = _build
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    return code, log.read_text(errors="replace")

"""Test-only fault injection. Off unless the environment variable KVSEAL_TEST_FAULTS names faults.

It is read once at worker start into a frozen Faults value that is passed explicitly; it is absent from
--help, and a worker with any fault on prints a loud warning at start.

    KVSEAL_TEST_FAULTS="flip_byte"                  corrupt one byte of one page in flight
    KVSEAL_TEST_FAULTS="short_pages"                send one page fewer than reserved
    KVSEAL_TEST_FAULTS="short_tokens"               claim one token fewer than reserved
    KVSEAL_TEST_FAULTS="wrong_nonce"                a manifest with another nonce
    KVSEAL_TEST_FAULTS="wrong_request_id"           a manifest naming another request
    KVSEAL_TEST_FAULTS="prefill_reject_over=100"    prefill refuses prompts over 100 tokens (its own error)
    KVSEAL_TEST_FAULTS="incident"                   the 2026 bug, back on purpose: a prompt over the prefill
                                                    pool becomes a one-token placeholder that keeps flowing,
                                                    decode skips verification, pages are not scrubbed, and the
                                                    router only warns when a pool is smaller than the window
    KVSEAL_TEST_FAULTS="stall_transfer=5"           prefill holds each handoff 5 s before sending it
    KVSEAL_TEST_FAULTS="control"                    no fault yet, but tests may set faults at run time
                                                    through the SetFaultsReq control message
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import msgspec

from kvseal.transfer.manifest import KVManifest, PagePayload

ENV = "KVSEAL_TEST_FAULTS"
_FLAGS = ("flip_byte", "short_pages", "short_tokens", "wrong_nonce", "wrong_request_id", "control", "incident")


@dataclass(frozen=True)
class Faults:
    flags: frozenset[str] = frozenset()
    prefill_reject_over: int | None = None
    stall_transfer_s: float = 0.0

    @property
    def any(self) -> bool:
        return bool(self.flags) or self.prefill_reject_over is not None or self.stall_transfer_s > 0

    @property
    def incident(self) -> bool:
        return "incident" in self.flags

    def mutate(self, m: KVManifest, p: PagePayload) -> tuple[KVManifest, PagePayload]:
        """Applied by the sender's transport just before the bytes go on the wire."""
        if "flip_byte" in self.flags and p.nbytes:
            k = p.k.clone()
            k[k.numel() // 2] ^= 0x01
            p = PagePayload(k, p.v, p.num_pages)
        if "short_pages" in self.flags and p.num_pages > 0:
            step = p.k.numel() // p.num_pages
            p = PagePayload(p.k[:-step], p.v[:-step], p.num_pages - 1)
            m = msgspec.structs.replace(m, num_pages=m.num_pages - 1, page_checksums=m.page_checksums[:-1])
        if "short_tokens" in self.flags:
            m = msgspec.structs.replace(m, num_tokens=m.num_tokens - 1)
        if "wrong_nonce" in self.flags:
            m = msgspec.structs.replace(m, nonce="0" * len(m.nonce))
        if "wrong_request_id" in self.flags:
            m = msgspec.structs.replace(m, request_id=m.request_id + "-other")
        return m, p


def from_env(environ: dict[str, str] | None = None) -> Faults:
    return parse((environ if environ is not None else dict(os.environ)).get(ENV, ""))


def parse(raw: str) -> Faults:
    raw = raw.strip()
    if not raw:
        return Faults()
    flags: set[str] = set()
    reject_over = None
    stall = 0.0
    for item in (x.strip() for x in raw.split(",") if x.strip()):
        name, _, value = item.partition("=")
        if name == "prefill_reject_over":
            reject_over = int(value)
        elif name == "stall_transfer":
            stall = float(value)
        elif name in _FLAGS:
            flags.add(name)
        else:
            raise ValueError(f"{ENV}: unknown fault {name!r}")
    return Faults(frozenset(flags), reject_over, stall)


def warn_if_on(faults: Faults, who: str) -> None:
    if faults.any:
        bar = "!" * 78
        print(f"{bar}\n!! {who}: TEST FAULT INJECTION IS ON ({ENV}): {sorted(faults.flags)} "
              f"reject_over={faults.prefill_reject_over} stall={faults.stall_transfer_s}\n!! THIS PROCESS IS BROKEN ON PURPOSE. NEVER SERVE "
              f"USERS WITH IT.\n{bar}", file=sys.stderr, flush=True)

"""Test-only fault injection behind the `kvseal.hooks.Hooks` seams. Off unless `--test-faults SPEC` names faults.

The flag is absent from --help, every process it is given to prints a loud warning at start, reports its faults
in /info (`test_faults`, `test_faults_active`), and the router refuses a worker whose faults differ from its own:
a fleet is all-clean or all on the same faults. A spec that names an unknown fault or gives a bad value refuses
to start. SPEC is a comma-separated list:

    flip_byte                  prefill corrupts one page in flight (ZeroMQ: one byte of the packed copy; NIXL:
                               the first page is offered from the pool page after it)
    short_pages                prefill sends one page fewer than reserved
    short_tokens               prefill claims one token fewer than reserved
    wrong_nonce                prefill's manifest carries another nonce
    wrong_request_id           prefill's manifest names another request
    prefill_reject_over=N      prefill refuses prompts over N tokens (with its own error)
    stall_transfer=S           prefill holds each handoff S seconds (finite, >= 0) before sending it
    incident                   the 2026 bug, back on purpose: a prompt over the prefill pool becomes a one-token
                               placeholder that keeps flowing, decode skips verification, pages are not scrubbed,
                               and the router only warns when a pool is smaller than the window
    file=PATH                  tests change faults at run time by writing a spec (without file= and incident)
                               to PATH; it is re-read when it changes. No other channel changes faults.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import msgspec

from kvseal.errors import InvalidRequest
from kvseal.hooks import NO_FAULTS, Hooks
from kvseal.wire.messages import GenerateRequest

if TYPE_CHECKING:  # a router reads the faults too, and imports no torch; only prefill touches the pages
    from kvseal.transfer.manifest import KVManifest, PagePayload, PoolPages

log = logging.getLogger("kvseal.faults")
FLAG = "--test-faults"
_FLAGS = frozenset({"flip_byte", "short_pages", "short_tokens", "wrong_nonce", "wrong_request_id", "incident"})
_VALUED = frozenset({"prefill_reject_over", "stall_transfer", "file"})
_REFRESH_S = 0.05
PLACEHOLDER_RECORD = "incident fault: replaced by a one-token placeholder:"


@dataclass(frozen=True)
class FaultSet:
    flags: frozenset[str] = frozenset()
    prefill_reject_over: int | None = None
    stall_transfer_s: float = 0.0
    file: str | None = None

    def canonical(self) -> str:
        items = sorted(self.flags)
        for name, value in (("prefill_reject_over", self.prefill_reject_over), ("file", self.file)):
            if value is not None:
                items.append(f"{name}={value}")
        if self.stall_transfer_s:
            items.append(f"stall_transfer={self.stall_transfer_s:g}")
        return ",".join(sorted(items))

    def merged(self, other: FaultSet) -> FaultSet:
        return FaultSet(self.flags | other.flags,
                        other.prefill_reject_over if other.prefill_reject_over is not None
                        else self.prefill_reject_over,
                        other.stall_transfer_s or self.stall_transfer_s, self.file)


def parse(raw: str, *, runtime: bool = False) -> FaultSet:
    """Strict: raises ValueError naming the item for an unknown fault, a missing or bad value, or a repeat.
    runtime: the spec read from a file= file (no file= and no incident there: those only act at start)."""
    where = "the runtime faults file" if runtime else FLAG
    out = FaultSet()
    seen: set[str] = set()
    for item in (x.strip() for x in raw.split(",")):
        if not item:
            continue
        name, eq, value = item.partition("=")
        name = name.strip()
        if name not in _FLAGS | _VALUED:
            raise ValueError(f"{where}: unknown fault {name!r}; known: {', '.join(sorted(_FLAGS | _VALUED))}")
        if name in seen:
            raise ValueError(f"{where}: {name!r} is given twice")
        seen.add(name)
        if runtime and name in ("file", "incident"):
            raise ValueError(f"{where}: {name!r} acts only at start; give it to {FLAG}")
        if name in _FLAGS:
            if eq:
                raise ValueError(f"{where}: {name!r} takes no value, got {item!r}")
            out = replace(out, flags=out.flags | {name})
            continue
        if not value.strip():
            raise ValueError(f"{where}: {name!r} needs a value ({name}=...)")
        out = _set_value(out, name, value.strip(), where)
    return out


def _set_value(out: FaultSet, name: str, value: str, where: str) -> FaultSet:
    if name == "file":
        return replace(out, file=value)
    if name == "stall_transfer":
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"{where}: stall_transfer={value!r} is not a finite number of seconds >= 0")
        return replace(out, stall_transfer_s=seconds)
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{where}: {name}={value!r} is not a whole number >= 0")
    return replace(out, prefill_reject_over=n)


class InjectedFaults(Hooks):
    """The hooks with faults on. `start` is fixed for the process; a file= file may add to it at run time."""

    def __init__(self, start: FaultSet) -> None:
        self.start = start
        self.spec = start.canonical()
        self.now = start
        self._stamp: tuple[int, int] | None = None
        self._next_check = 0.0

    @property
    def active(self) -> str:
        return self.now.canonical()

    def refresh(self) -> None:
        if self.start.file is None or time.monotonic() < self._next_check:
            return
        self._next_check = time.monotonic() + _REFRESH_S
        try:
            st = os.stat(self.start.file)
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            with open(self.start.file, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            stamp, text = (0, 0), ""
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self.now = self.start.merged(parse(text, runtime=True))
        except ValueError as exc:  # keep the previous faults; the test waiting for the new ones sees it
            log.error("ignoring the runtime faults file %s: %s", self.start.file, exc)
            return
        log.warning("test faults now: %s", self.active or "none")

    def admit_prefill(self, req: GenerateRequest, context_window: int) -> GenerateRequest:
        over = self.now.prefill_reject_over
        if over is not None and len(req.prompt_ids) > over:
            raise InvalidRequest(f"prefill worker policy refused a prompt of {len(req.prompt_ids)} tokens "
                                 f"(limit {over})", code="prefill_policy")
        if "incident" in self.now.flags and len(req.prompt_ids) + req.params.max_tokens > context_window:
            # THE 2026 BUG: "reject" by swapping in a one-token placeholder that keeps flowing. The fault's own
            # record (one line per request, tests check `kvseal incidents` against it):
            log.warning("%s %s (%d prompt tokens)", PLACEHOLDER_RECORD, req.request_id, len(req.prompt_ids))
            return msgspec.structs.replace(req, prompt_ids=req.prompt_ids[:1],
                                           params=msgspec.structs.replace(req.params, max_tokens=1))
        return req

    def hold_handoff_s(self) -> float:
        return self.now.stall_transfer_s

    def outgoing_kv(self, m: KVManifest,
                    p: PagePayload | PoolPages) -> tuple[KVManifest, PagePayload | PoolPages]:
        flags = self.now.flags
        if "flip_byte" in flags and p.nbytes:
            p = _corrupted(p)
        if "short_pages" in flags and p.num_pages > 0:
            p = _short(p)
            m = msgspec.structs.replace(m, num_pages=m.num_pages - 1, page_checksums=m.page_checksums[:-1])
        if "short_tokens" in flags:
            m = msgspec.structs.replace(m, num_tokens=m.num_tokens - 1)
        if "wrong_nonce" in flags:
            m = msgspec.structs.replace(m, nonce="0" * len(m.nonce))
        if "wrong_request_id" in flags:
            m = msgspec.structs.replace(m, request_id=m.request_id + "-other")
        return m, p

    def verify_kv(self) -> bool:
        return "incident" not in self.now.flags

    def scrub_pages(self, configured: bool) -> bool:
        return configured and "incident" not in self.now.flags

    def capacity_check(self) -> bool:
        return "incident" not in self.now.flags


def _corrupted(p: PagePayload | PoolPages) -> PagePayload | PoolPages:
    """One page that differs in flight from what the manifest's checksums describe."""
    from kvseal.transfer.manifest import PagePayload, PoolPages

    if isinstance(p, PoolPages):  # an in-place transport reads the first page from the pool page after it
        moved = (p.page_ids[0] + 1) % p.k.shape[1]
        return PoolPages(p.k, p.v, (moved, *p.page_ids[1:]))
    k = p.k.clone()
    k[k.numel() // 2] ^= 0x01
    return PagePayload(k, p.v, p.num_pages)


def _short(p: PagePayload | PoolPages) -> PagePayload | PoolPages:
    from kvseal.transfer.manifest import PagePayload, PoolPages

    if isinstance(p, PoolPages):
        return PoolPages(p.k, p.v, p.page_ids[:-1])
    step = p.k.numel() // p.num_pages
    return PagePayload(p.k[:-step], p.v[:-step], p.num_pages - 1)


def hooks_from_spec(raw: str | None, who: str) -> Hooks:
    """The hooks for a process started with `--test-faults raw` (None or "" -> the product's no-op hooks)."""
    if not raw or not raw.strip():
        return NO_FAULTS
    faults = InjectedFaults(parse(raw))
    faults.refresh()
    bar = "!" * 78
    print(f"{bar}\n!! {who}: TEST FAULT INJECTION IS ON ({FLAG} {faults.spec})\n!! THIS PROCESS IS BROKEN ON "
          f"PURPOSE. NEVER SERVE USERS WITH IT.\n{bar}", file=sys.stderr, flush=True)
    return faults

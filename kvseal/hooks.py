"""The seams where tests inject faults: one interface, and this no-op implementation for every real deployment.

Product modules call a hook at a fixed point of their path and never test for a fault by name; what a fault does
lives in `kvseal/faults.py` (test-only, on only with `--test-faults`). Every hook here returns its input or the
normal answer, so a process started without faults runs exactly the product path.

    hook                   called by                        normal answer
    refresh()              every worker loop turn           nothing (faults changed at run time are re-read)
    admit_prefill(req, w)  prefill, per request             req unchanged (may raise a KvsealError: refuse it)
    hold_handoff_s()       prefill, per ready handoff       0.0: send the KV at once
    outgoing_kv(m, p)      prefill's transport, per send    (m, p) unchanged
    verify_kv()            decode, per arrival              True: verify before use (seal 4)
    scrub_pages(on)        worker start                     on: as configured (seal 6)
    capacity_check()       router, at start and every join  True: refuse what breaks seal 7
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvseal.wire.messages import GenerateRequest

if TYPE_CHECKING:  # the router holds hooks too, and imports no torch (the manifest's pages are tensors)
    from kvseal.transfer.manifest import KVManifest, PagePayload, PoolPages


class Hooks:
    # the faults this process was started with, canonical ("" for none). The fleet check compares it: a fleet
    # is either all-clean or all on the same faults, so a stray test setting never joins a clean fleet.
    spec: str = ""

    @property
    def active(self) -> str:
        """The faults in force now (canonical); differs from `spec` only when tests change them at run time."""
        return ""

    def refresh(self) -> None:
        pass

    def admit_prefill(self, req: GenerateRequest, context_window: int) -> GenerateRequest:
        return req

    def hold_handoff_s(self) -> float:
        return 0.0

    def outgoing_kv(self, manifest: KVManifest,
                    payload: PagePayload | PoolPages) -> tuple[KVManifest, PagePayload | PoolPages]:
        """payload: the packed copy a staging transport sends, or the pool pages an in-place one offers."""
        return manifest, payload

    def verify_kv(self) -> bool:
        return True

    def scrub_pages(self, configured: bool) -> bool:
        return configured

    def capacity_check(self) -> bool:
        return True


NO_FAULTS = Hooks()

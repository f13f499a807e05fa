"""What KV is: the identity and geometry a page of KV must share between the worker that computed it and the one
that uses it. Imports nothing of kvseal's (the transfer manifest, the engine, the worker card and the router's
fleet check all read it).

Two workers may hand KV to each other only when their KVSpecs are equal (seal 7, checked at start and at every
join), and decode uses arrived KV only when the manifest's KVSpec equals the one in its reservation (seal 4).
"""

from __future__ import annotations

import msgspec


class KVSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Every field is compared, in this order, wherever KV crosses a process boundary; a new field is compared
    everywhere at once (`differences`)."""

    model_fingerprint: str  # sha256 over the weights' bytes (model/file_index.py)
    page_size: int  # tokens per page
    kv_dtype: str  # "bfloat16", "float32", ... (transfer/manifest.py dtype_name)
    kv_layout: str  # the pool's layout and geometry, e.g. "L30xPxSx3x64" or "kt:L30xPx3x64xS" (kv/pool.py)

    def fields(self) -> dict[str, object]:
        """Field name -> value, in declaration order (the keys /info shows them under)."""
        return {name: getattr(self, name) for name in self.__struct_fields__}

    def differences(self, other: KVSpec) -> list[tuple[str, object, object]]:
        """(field, ours, theirs) for every field in which `other` differs, in declaration order."""
        return [(name, getattr(self, name), getattr(other, name)) for name in self.__struct_fields__
                if getattr(self, name) != getattr(other, name)]

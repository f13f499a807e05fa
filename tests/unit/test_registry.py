"""Seal 7's fleet check as a function: every field that must agree is compared, all differences are named."""

from __future__ import annotations

import pytest

from kvseal.errors import CapacityMismatch
from kvseal.router.registry import check_fleet

BASE = {"model_fingerprint": "f", "page_size": 16, "kv_dtype": "float32", "kv_layout": "kt:L30xPx3x64xS",
        "kernels": "native", "arithmetic": "fast/int8", "pool_tokens": 8192}


@pytest.mark.parametrize(("field", "value"), [("model_fingerprint", "g"), ("page_size", 32), ("kv_dtype", "bfloat16"),
                                              ("kv_layout", "L30xPxSx3x64"), ("kernels", "torch"),
                                              ("arithmetic", "exact/native")])
def test_a_worker_that_differs_in_any_field_is_refused(field: str, value: object) -> None:
    with pytest.raises(CapacityMismatch, match=f"{field}={value!r}.*but.*{field}={BASE[field]!r}"):
        check_fleet([("prefill 1", BASE), ("decode 1", {**BASE, field: value})], 4096)


def test_every_difference_is_named_at_once_and_a_small_pool_is_refused() -> None:
    other = {**BASE, "arithmetic": "exact/native", "kv_layout": "L30xPxSx3x64"}
    with pytest.raises(CapacityMismatch) as e:
        check_fleet([("prefill 1", BASE), ("decode 1", other)], 4096)
    assert "kv_layout='L30xPxSx3x64'" in str(e.value) and "arithmetic='exact/native'" in str(e.value)
    with pytest.raises(CapacityMismatch, match="holds 2048 tokens"):
        check_fleet([("prefill 1", BASE), ("decode 1", {**BASE, "pool_tokens": 2048})], 4096)
    check_fleet([("prefill 1", BASE), ("decode 1", dict(BASE))], 8192)  # an agreeing fleet passes

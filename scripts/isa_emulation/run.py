"""One library's fast products for every quantized type, hashed: the instruction set is KVSEAL_QISA (run.sh)."""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys

import torch

from tests.unit.test_kernels import random_blocks

lib = ctypes.CDLL(sys.argv[1])
i64, ptr = ctypes.c_int64, ctypes.c_void_p
lib.kvs_qpacked_bytes.argtypes, lib.kvs_qpacked_bytes.restype = [ctypes.c_int, i64, i64], i64
lib.kvs_qpack.argtypes = [ctypes.c_int, ptr, i64, i64, ptr]
lib.kvs_qlinear.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr]
lib.kvs_set_threads(1)
N = 64  # whole tiles: SIMDe emulates a masked store by writing all 16 lanes, real AVX-512 writes only the mask's
out: dict[str, object] = {"isa": lib.kvs_qisa()}
for qt in (2, 3, 6, 8, 12, 13, 14):
    k = 512 if qt >= 12 else 192
    w = random_blocks(qt, N, k, seed=qt)
    buf = torch.empty(lib.kvs_qpacked_bytes(qt, N, k), dtype=torch.uint8)
    lib.kvs_qpack(qt, w.data.data_ptr(), N, k, buf.data_ptr())
    for m in (1, 5, 11, 40):  # 11 (Q5_K, Q6_K) and 40 (every type): AVX-512-VNNI over unpacked tiles
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(qt + m))
        y = torch.empty(m, N)
        assert lib.kvs_qlinear(qt, buf.data_ptr(), N, k, x.data_ptr(), m, y.data_ptr()) == 0
        out[f"{qt}/{m}"] = hashlib.sha256(y.numpy().tobytes()).hexdigest()[:16]
print(json.dumps(out))

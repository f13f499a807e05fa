#!/bin/bash
# mixed load: steady decoding streams (A) while long prompts arrive (B); report A's TPOT
# usage: bash scripts/bench_mixed.sh   (results in $OUT, default bench_out/mixed; STEADY=48 steady requests)
cd "$(dirname "$0")/.." && mkdir -p "${OUT:-bench_out/mixed}"
for mode in unified disagg; do
  if [ $mode = unified ]; then extra="--unified"; else extra="--prefill 1 --decode 1"; fi
  port=$((8300 + RANDOM % 500))
  .venv/bin/kvseal serve $extra --port $port --max-model-len 2048 --kv-pool-tokens 16384 --wait-timeout 3600 --log-level warning > ${OUT:-bench_out/mixed}/serve_$mode.log 2>&1 &
  sp=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
  .venv/bin/kvseal bench --base-url http://127.0.0.1:$port --dataset fixed --input-len 128 --output-len 128 --num-prompts ${STEADY:-48} --max-concurrency 8 --no-progress --result-json ${OUT:-bench_out/mixed}/steady_$mode.json > ${OUT:-bench_out/mixed}/steady_$mode.out 2>&1 &
  a=$!
  sleep 15
  .venv/bin/kvseal bench --base-url http://127.0.0.1:$port --dataset fixed --input-len 1500 --output-len 4 --num-prompts 4 --request-rate 0.1 --seed 7 --warmup 0 --no-progress --result-json ${OUT:-bench_out/mixed}/long_$mode.json > ${OUT:-bench_out/mixed}/long_$mode.out 2>&1
  wait $a
  kill $sp; wait $sp
done
echo finished

#!/usr/bin/env bash
# The prefix-cache side-by-side: the same `kvseal bench --dataset prefix` load against kvseal (unified and
# disaggregated, the cache on and off), vLLM's CPU build (automatic prefix caching on, its default) and
# llama-server (cache_prompt on, its default), one server at a time so they never share the CPU.
#
#   PEERS=~/.cache/kvseal-peers bash scripts/bench_prefix.sh OUT_DIR [SYSTEM ...]
#
# SYSTEM: kvseal kvseal-nocache kvseal-disagg kvseal-disagg-nocache vllm llama-server (default: all; the peers
# are skipped when $PEERS lacks them, see shared/peers.md for how they are installed). Extra load flags: $LOAD.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench_prefix.sh OUT_DIR [SYSTEM ...]}; shift
systems=("$@"); [ ${#systems[@]} -gt 0 ] || systems=(kvseal kvseal-nocache kvseal-disagg kvseal-disagg-nocache vllm llama-server)
mkdir -p "$out"
PEERS=${PEERS:-$HOME/.cache/kvseal-peers}
GGUF=$(.venv/bin/python -c "from kvseal.model.loader import default_model_path; print(default_model_path())")
LOAD=${LOAD:---dataset prefix --prefix-len 512 --suffix-len 64 --num-prefixes 4 --output-len 32 --num-prompts 64 --max-concurrency 16 --warmup 1 --seed 0}
port=18555

start() {  # start "$@" in the background, wait for /health
  "$@" > "$out/$name.server.log" 2>&1 &
  pid=$!
  for _ in $(seq 400); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && return 0
    kill -0 $pid 2> /dev/null || { echo "$name exited; see $out/$name.server.log" >&2; return 1; }
    sleep 1
  done
  echo "$name not ready" >&2; return 1
}

for name in "${systems[@]}"; do
  case $name in
    kvseal) cmd=(.venv/bin/kvseal serve --unified --port $port --max-model-len 4096) ;;
    kvseal-nocache) cmd=(.venv/bin/kvseal serve --unified --port $port --max-model-len 4096 --no-prefix-cache) ;;
    kvseal-disagg) cmd=(.venv/bin/kvseal serve --port $port --max-model-len 4096) ;;
    kvseal-disagg-nocache) cmd=(.venv/bin/kvseal serve --port $port --max-model-len 4096 --no-prefix-cache) ;;
    vllm)
      [ -x "$PEERS/vllm/bin/vllm" ] || { echo "skipping vllm: not in $PEERS" >&2; continue; }
      cmd=(env VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 HF_HUB_OFFLINE=1 "$PEERS/vllm/bin/vllm" serve
           "$PEERS/models/SmolLM2-135M-Instruct" --served-model-name SmolLM2-135M-Instruct --dtype bfloat16
           --max-model-len 4096 --port $port) ;;
    llama-server)
      [ -x "$PEERS/bin/llama-server" ] || { echo "skipping llama-server: not in $PEERS" >&2; continue; }
      cmd=("$PEERS/bin/llama-server" -m "$GGUF" -t 2 -tb 2 -np 16 -c 16384 -cb --port $port) ;;
    *) echo "unknown system $name" >&2; exit 2 ;;
  esac
  echo "== $name: ${cmd[*]}" | tee -a "$out/commands.txt"
  start "${cmd[@]}" || continue
  # shellcheck disable=SC2086
  .venv/bin/kvseal bench --base-url "http://127.0.0.1:$port" $LOAD --no-progress --result-json "$out/$name.json" \
    | tee "$out/$name.txt" || true
  echo "   load: kvseal bench $LOAD" >> "$out/commands.txt"
  curl -sf "http://127.0.0.1:$port/info" > "$out/$name.info.json" || true
  kill $pid; wait $pid 2> /dev/null || true
  sleep 3
done

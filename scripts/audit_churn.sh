#!/usr/bin/env bash
# The 2,000-request audit with aborts and worker restarts mid-run (docs/audit-churn.md).
#
# Two prefill and two decode workers behind one router on loopback. While `kvseal audit` sends its 2,000 canary
# requests (and its over-window and consistency prompts), scripts/abort_load.py sends requests whose clients
# leave mid-way, and the workers are restarted on their ports: decode 1 drained (`kvseal drain`) and started
# again, prefill 1 killed (SIGKILL) and started again, decode 2 killed and started again (at 20%, 50% and 70%
# of the audit's load phase). Each new process
# rejoins only through the fleet check. At the end every pool must be at baseline.
#
#   scripts/audit_churn.sh [OUT_DIR]      (about 40 minutes on 2 cores)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench_out/audit-churn}
mkdir -p "$OUT"
PY=.venv/bin/python
ENGINE=(--max-model-len 512 --kv-pool-tokens 8192 --threads 1 --log-level info)
P1=7301 P2=7302 D1=7303 D2=7304 ROUTER=8300 URL=http://127.0.0.1:8300

start() {  # role port: start one worker, its log in $OUT, its pid in $OUT/role-port.pid
    $PY -m kvseal "$1" "${ENGINE[@]}" --port "$2" >> "$OUT/$1-$2.log" 2>&1 &
    echo $! > "$OUT/$1-$2.pid"
}
ready() { until grep -q "worker ready on" "$OUT/$1-$2.log" 2>/dev/null; do sleep 1; done; }
serving() {  # port: until the router shows that worker serving again
    until curl -s $URL/info | $PY -c "import json,sys; d=json.load(sys.stdin); sys.exit(0 if any(w['endpoint'].endswith(':$1') and w['state']=='serving' for w in d['workers']) else 1)"; do sleep 1; done
}
note() { echo "$(date +%T) $*" | tee -a "$OUT/events.log"; }
at() {  # N: until the audit has answered N of its load requests (it prints every tenth)
    until grep -q "audit load: $1/" "$OUT/audit.err" 2>/dev/null; do sleep 1; done
}

start prefill $P1; start prefill $P2; start decode $D1; start decode $D2
for w in "prefill $P1" "prefill $P2" "decode $D1" "decode $D2"; do ready $w; done
$PY -m kvseal router --port $ROUTER --prefill 127.0.0.1:$P1 --prefill 127.0.0.1:$P2 \
    --decode 127.0.0.1:$D1 --decode 127.0.0.1:$D2 > "$OUT/router.log" 2>&1 &
ROUTER_PID=$!
until curl -sf $URL/health > /dev/null; do sleep 1; done
note "fleet up"

$PY -m kvseal audit $URL --requests 2000 --concurrency 32 --max-tokens 24 --timeout 900 --max-duration 7000 \
    --seed 2026 --report "$OUT/audit_report.json" > "$OUT/audit.txt" 2> "$OUT/audit.err" &
AUDIT=$!
$PY scripts/abort_load.py $URL --requests 400 --concurrency 8 --spread 240 --seed 7 > "$OUT/aborts.json" &
ABORTS=$!

at 402
note "drain decode $D1"; .venv/bin/kvseal drain 127.0.0.1:$D1 | tee -a "$OUT/events.log"
while kill -0 "$(cat "$OUT/decode-$D1.pid")" 2>/dev/null; do sleep 1; done
note "decode $D1 exited (drained); starting it again"; start decode $D1; ready decode $D1; serving $D1
note "decode $D1 serving again"

at 1005
note "SIGKILL prefill $P1"; kill -9 "$(cat "$OUT/prefill-$P1.pid")"; sleep 2
start prefill $P1; ready prefill $P1; serving $P1; note "prefill $P1 serving again"

at 1407
note "SIGKILL decode $D2"; kill -9 "$(cat "$OUT/decode-$D2.pid")"; sleep 2
start decode $D2; ready decode $D2; serving $D2; note "decode $D2 serving again"

wait $AUDIT; echo "audit exit $?" | tee -a "$OUT/events.log"
wait $ABORTS
sleep 5
curl -s $URL/info > "$OUT/info_after.json"
grep -c "kvseal.requests" "$OUT/router.log" | xargs echo "router log lines for requests that did not complete:" \
    | tee -a "$OUT/events.log"
kill $ROUTER_PID
for f in "$OUT"/*.pid; do kill "$(cat "$f")" 2>/dev/null; done
wait

#!/usr/bin/env bash
# TTFT and TPOT with and without the step-time target (issue 31), side by side: one colocated node
# (mixed batches: long prompts chunked beside running decodes) at 1 and at 2 torch threads, the
# default model, `pdserve bench serve` at a Poisson rate. "off" is --max-step-seconds 1000 (the
# budget never shrinks: every step takes up to --max-num-batched-tokens 2048). Runs alternate.
#   bench/step_target.sh [RATE] [NUM_REQUESTS] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-0.5}
NUM=${2:-16}
OUT=${3:-/tmp/step-target}
mkdir -p "$OUT"
PY=.venv/bin/python
for threads in 1 2; do
  for target in auto off; do
    [ -s "$OUT/$threads-$target.json" ] && [ -n "${RESUME:-}" ] && continue  # RESUME=1: keep finished runs
    args="--max-step-seconds 1000"
    [ "$target" = auto ] && args=""
    port=$((8300 + threads * 10 + ${#target}))
    $PY -m pdserve up --colocated 1 --threads "$threads" --port "$port" --no-redis \
      --node-args="--kv-commit startup $args" --log-dir "$OUT/logs-$threads-$target" >"$OUT/up-$threads-$target.log" 2>&1 &
    up=$!
    for _ in $(seq 240); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
    $PY -m pdserve bench serve --base-url "http://127.0.0.1:$port" --workload mix --input-len 1024 \
      --max-input-len 1800 --output-len 48 --num-requests "$NUM" --request-rate "$RATE" --seed 31 \
      --warmup-requests 2 --no-progress --result-json "$OUT/$threads-$target.json" >"$OUT/bench-$threads-$target.log" 2>&1
    kill -TERM $up; wait $up || true  # (a background job ignores SIGINT)
    $PY - "$OUT/$threads-$target.json" "$threads" "$target" <<'PYEOF'
import json, sys
s = json.load(open(sys.argv[1]))["runs"][0]["summary"]
ms = lambda k, q: f"{s[k][q] * 1e3:8.0f}" if s.get(k) else "       -"
print(f"| {sys.argv[2]} | {sys.argv[3]:4} | {s['num_ok']}/{s['num_sent']} | {ms('ttft', 'p50')} | {ms('ttft', 'p99')} "
      f"| {ms('tpot', 'p50')} | {ms('tpot', 'p99')} | {ms('itl', 'p99')} |", flush=True)
PYEOF
  done
done

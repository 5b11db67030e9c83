#!/usr/bin/env bash
# Two workers on one GPU, started one after the other in either order, each with half of 0.9 of it: the KV capacity
# each reports on its ready line must not depend on which sized its cache first. Then `disagg up` with no memory
# flags (its default one-GPU layout: prefill and decode sharing the GPU), whose summary says each worker's capacity.
# Usage: bash benchmarks/gpu/kv_share_order.sh MODEL_DIR [engine flags...]   (e.g. --load-format dummy --dtype bfloat16)
set -u
MODEL=$1; shift
FLAGS=(--device cuda --model "$MODEL" --port 0 --metrics-port -1 --gpu-memory-utilization 0.45 "$@")
start() {  # start a worker in the background, wait for its ready line, print it
  local log pid; log=$(mktemp); setsid python3 -u -m "services.$1" "${FLAGS[@]}" >"$log" 2>&1 &
  pid=$!; echo $pid >>/tmp/kv_share_pids
  for _ in $(seq 600); do grep -q "serving on" "$log" && break; kill -0 $pid 2>/dev/null || break; sleep 0.2; done
  echo "$1: $(grep -h 'serving on\|KV cache\|Error\|error' "$log" | head -3)"
}
stop() { xargs -r kill </tmp/kv_share_pids 2>/dev/null; sleep 3; : >/tmp/kv_share_pids; }
: >/tmp/kv_share_pids
echo "== prefill first"; start prefill; start decode; nvidia-smi --query-gpu=memory.used --format=csv,noheader; stop
echo "== decode first"; start decode; start prefill; nvidia-smi --query-gpu=memory.used --format=csv,noheader; stop
echo "== disagg up, no memory flags"
log=$(mktemp); setsid python3 -u -m services up --device cuda --model "$MODEL" --router-port 0 --http-port 0 "$@" >"$log" 2>&1 &
up=$!; for _ in $(seq 900); do grep -q -E "A process that dies|exited with|failed" "$log" && break; kill -0 $up 2>/dev/null || break; sleep 0.2; done
grep -E "prefill-0|decode-0|GPUs shared|failed|Error" "$log" | head -8; nvidia-smi --query-gpu=memory.used --format=csv,noheader
kill -INT $up; sleep 8

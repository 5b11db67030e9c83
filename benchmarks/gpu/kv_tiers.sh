#!/usr/bin/env bash
# #58's two targets for one GPU in one call: the tiers' offload and onboard (the engine's KvTiers path) against a
# pinned copy of the same bytes, then the multi-turn chat with no tiers, the host tier and host + disk on a model
# directory of random weights (its config.json and tokenizer; no weights are read). Logs and the JSON under $OUT
# (or ./gpu-logs). Usage: bash benchmarks/gpu/kv_tiers.sh MODEL_DIR [multi_turn args...]
#   BANDWIDTH_S / TURNS_S: time limits of each part (seconds); 0 skips the part.
set -o pipefail
MODEL=${1:?usage: kv_tiers.sh MODEL_DIR [multi_turn args...]}
shift
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast (KINDS.md)
if [ "${BANDWIDTH_S:-120}" != 0 ]; then
  echo "== KV tier bandwidth"; timeout "${BANDWIDTH_S:-120}" python3 -m benchmarks.kv_tier_bandwidth --device cuda \
    --shape llama-3.2-3b --rounds 5 2>&1 | tee "$OUT/kv_tier_bandwidth.log"; echo "bandwidth rc=$?"
fi
if [ "${TURNS_S:-420}" != 0 ]; then
  echo "== multi-turn"; timeout "${TURNS_S:-420}" python3 -m benchmarks.multi_turn --dtype bfloat16 \
    --configs none,host,host+disk --ignore-eos --up-args "--device cuda --model $MODEL --load-format dummy" \
    --json "$OUT/multi_turn.json" "$@" 2>&1 | tee "$OUT/multi_turn.log"; echo "multi-turn rc=$?"
fi

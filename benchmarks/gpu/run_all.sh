#!/usr/bin/env bash
# Everything the GPU machine checks for the engine, in one call: the roofline bench, the GPU tests, the decode
# attention sweep. Logs under $OUT (or ./gpu-logs). Usage: bash benchmarks/gpu/run_all.sh [bench args...]
#   BENCH_S / TESTS_S / SWEEP_S / TP_S: time limits of each part (seconds); 0 skips the part. TESTS_K: a pytest -k
#   filter. The tensor-parallel part (its tests, then its bench) runs where two GPUs are visible.
set -o pipefail
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast (KINDS.md)
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/gpu.txt"
if [ "${BENCH_S:-240}" != 0 ]; then
  echo "== bench"; timeout "${BENCH_S:-240}" python3 -m benchmarks.gpu_engine_vs_hf --model llama-3.2-1b --skip-hf \
    --skip-hf-continuous --profile-dir "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"; echo "bench rc=$?"
fi
if [ "${TESTS_S:-300}" != 0 ]; then
  # test_multi_gpu before test_kv_plane_gpu: an engine on the last GPU, then one on GPU 0 in the same process (#36)
  echo "== gpu tests"; timeout "${TESTS_S:-300}" python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused_kernels.py \
    tests/gpu/test_gemv.py tests/gpu/test_gpu_kernels.py tests/gpu/test_decode_tunings.py tests/gpu/test_prefill_tunings.py tests/unit/test_async_scheduling.py \
    tests/gpu/test_multi_gpu.py tests/gpu/test_kv_plane_gpu.py tests/unit/test_kv_fence.py tests/unit/test_peer_copy.py \
    tests/gpu/test_fused_moe.py \
    ${TESTS_K:+-k "$TESTS_K"} > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$?"
  grep -E "passed|failed|error|Error|assert" "$OUT/gpu_tests.log" | tail -25
fi
if [ "${SWEEP_S:-0}" != 0 ]; then
  echo "== decode attention sweep"; timeout $((SWEEP_S + 60)) python3 -m benchmarks.gpu.sweep_decode_attention \
    --budget-s "$SWEEP_S" > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"; tail -8 "$OUT/sweep.log"
fi
if [ "${TP_S:-400}" != 0 ] && [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
  echo "== tensor parallelism (two GPUs)"; timeout "${TP_S:-400}" sh -c 'python3 -m pytest -q -s -p no:cacheprovider \
    tests/gpu/test_tensor_parallel_gpu.py && python3 -m benchmarks.tensor_parallel_gpu' > "$OUT/tp.log" 2>&1
  echo "tp rc=$?"; grep -E "passed|failed|figure|tensor-parallel rank" "$OUT/tp.log" | tail -20
fi

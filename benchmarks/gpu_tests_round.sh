#!/usr/bin/env bash
# Every GPU test in one H200 device call: `pytest -m gpu tests` across 8 workers on the one GPU,
# then the kernel files that pick CUDA by themselves (4-bit write, attention and k-transform,
# the ring of the newest tokens).
# Usage (device tool, repo root): bash benchmarks/gpu_tests_round.sh
# Writes under $OUT: env.log, gpu_tests_all.log, gpu_tests_kernels_cuda.log
set -u
OUT=${OUT:-./gpu_tests_out}
. "$(dirname "$0")/round_env.sh"
start=$(date +%s)
timeout "${ALL_TIMEOUT:-420}" python3 -m pytest -q -rfEs --tb=short --show-capture=no -m gpu \
  -n "${WORKERS:-8}" --dist load --durations=20 -p no:cacheprovider tests \
  > "$OUT/gpu_tests_all.log" 2>&1
echo "rc=$? wall_s=$(( $(date +%s) - start ))" >> "$OUT/gpu_tests_all.log"
tail -n 3 "$OUT/gpu_tests_all.log"
start=$(date +%s)
timeout "${KERNEL_TIMEOUT:-120}" python3 -m pytest -q -rfE --tb=short --show-capture=no \
  -n "${WORKERS:-8}" --dist load -p no:cacheprovider tests/kernels/test_write.py \
  tests/kernels/test_write_fp4.py tests/kernels/test_attention_fp4.py \
  tests/kernels/test_k_transform_fp4.py tests/kernels/test_k_transform_fp4_keys.py \
  tests/kernels/test_attention_recent.py tests/kernels/test_write_recent.py \
  > "$OUT/gpu_tests_kernels_cuda.log" 2>&1
echo "rc=$? wall_s=$(( $(date +%s) - start ))" >> "$OUT/gpu_tests_kernels_cuda.log"
tail -n 3 "$OUT/gpu_tests_kernels_cuda.log"

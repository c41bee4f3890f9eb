#!/usr/bin/env bash
# One H200 round for the ring of the newest tokens (recent_tokens): its kernel tests on CUDA and
# its GPU tests, the attention kernel's time with and without the ring (graph replay, per format),
# then the decode cost of the ring beside the same format without it, the arms run in both
# orders (E2E_ROUNDS times) since steps of one arm vary between runs.
# Usage (device tool, repo root): bash benchmarks/recent_round.sh
# With PROFILE=1 it first lists the GPU kernels of a B64 x 2k decode with and without the ring
# (profile_generate.py --kernels; the ring costs 13-26 % of that step, its attention nothing).
# Writes under $OUT: env.log, gpu_tests_recent.log, kernel_recent.json, e2e_recent_<i>_{ab,ba}.json
# (and profile_b64_recent.txt)
set -u
OUT=${OUT:-./recent_round_out}
E2E_ROUNDS=${E2E_ROUNDS:-2}
ARMS_A=${ARMS_A:-kvquant-fp32-group,kvquant-nvfp4}
ARMS_B=${ARMS_B:-kvquant-recent0,kvquant-nvfp4-recent0}
. "$(dirname "$0")/round_env.sh"
if [ "${PROFILE:-0}" = 1 ]; then
  timeout 200 python3 benchmarks/profile_generate.py --batch 64 --prompt 2048 --new 32 --kernels \
    --arms "${ARMS_A%%,*},${ARMS_B%%,*}" --out "$OUT/profile_b64_recent.txt" 2>&1 | tail -n 3
fi
{
  timeout 150 python3 -m pytest -q -rfE --tb=short --show-capture=no -n 8 -p no:cacheprovider \
    tests/kernels/test_attention_recent.py tests/kernels/test_write_recent.py
  timeout 150 python3 -m pytest -q -rfE --tb=short --show-capture=no -n 4 -p no:cacheprovider \
    -m gpu tests/hf/test_hf_recent_tokens.py
} > "$OUT/gpu_tests_recent.log" 2>&1
grep -E "passed|failed" "$OUT/gpu_tests_recent.log"
timeout 150 python3 benchmarks/bench_fp4_decode.py --formats fp8,fp8-group,nvfp4,fp8-k-nvfp4-v \
  --recent 16 --shapes 32x16384,16x8192 --out "$OUT/kernel_recent.json" 2>&1 | tail -n 4
for i in $(seq 1 "$E2E_ROUNDS"); do
  timeout 200 python3 benchmarks/e2e_generate.py --shapes "${SHAPES:-b16x8k,b64x2k}" --arms "$ARMS_A,$ARMS_B" \
    --repeats 3 --out "$OUT/e2e_recent_${i}_ab.json" 2>&1 | tail -n 12
  timeout 200 python3 benchmarks/e2e_generate.py --shapes "${SHAPES:-b16x8k,b64x2k}" --arms "$ARMS_B,$ARMS_A" \
    --repeats 3 --out "$OUT/e2e_recent_${i}_ba.json" 2>&1 | tail -n 12
done

#!/usr/bin/env bash
# One H200 round for the 4-bit pages and the decode step's host work, in one device call:
# every GPU test (the 4-bit ones on their own), the 4-bit decode kernels against FP8 per-tensor,
# and the B16 x 8k end-to-end decode with FP8 and NVFP4 pages beside transformers' default.
# Usage (device tool, repo root):  bash benchmarks/fp4_round.sh
#   timeouts (s): KERNEL_TIMEOUT, FP4_TIMEOUT, HF_TIMEOUT, BENCH_TIMEOUT, E2E_TIMEOUT
# Writes under $OUT: env.log, gpu_tests.log, gpu_tests_fp4.log, gpu_tests_hf.log,
#   fp4_decode.json, e2e_b16x8k.json
set -u
OUT=${OUT:-./fp4_round_out}
. "$(dirname "$0")/round_env.sh"
fp4=(tests/kernels/test_write_fp4.py tests/kernels/test_attention_fp4.py tests/kernels/test_fp4_codec.py
     tests/kernels/test_fp4_triton.py tests/cache/test_storage_fp4.py tests/schemes/test_schemes.py tests/hf/test_hf_fp4.py)
timeout "${KERNEL_TIMEOUT:-150}" python3 -m pytest -q -rfE -m gpu -n 8 tests/gpu tests/kernels \
  -p no:cacheprovider 2>&1 | tail -n 60 > "$OUT/gpu_tests.log"
tail -n 2 "$OUT/gpu_tests.log"
# the 4-bit tests run on the GPU when there is one (marked or not)
timeout "${FP4_TIMEOUT:-90}" python3 -m pytest -q -rfE -n 4 "${fp4[@]}" -p no:cacheprovider \
  2>&1 | tail -n 60 > "$OUT/gpu_tests_fp4.log"
tail -n 2 "$OUT/gpu_tests_fp4.log"
timeout "${HF_TIMEOUT:-150}" python3 -m pytest -q -rfE -m gpu -n 4 tests/hf \
  --ignore=tests/hf/test_hf_fp4.py -p no:cacheprovider 2>&1 | tail -n 100 > "$OUT/gpu_tests_hf.log"
tail -n 2 "$OUT/gpu_tests_hf.log"
timeout "${BENCH_TIMEOUT:-50}" python3 benchmarks/bench_fp4_decode.py --out "$OUT/fp4_decode.json" 2>&1 | tail -n 4
timeout "${E2E_TIMEOUT:-110}" python3 benchmarks/e2e_generate.py --shapes b16x8k \
  --arms default,kvquant,kvquant-nvfp4 --repeats 2 --out "$OUT/e2e_b16x8k.json" 2>&1 | tail -n 6

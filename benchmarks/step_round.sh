#!/usr/bin/env bash
# One H200 round for the decode step's time and the 4-bit pages, in one device call:
# the GPU tests (tests/gpu, tests/kernels; the 4-bit ones on their own, with full tracebacks),
# the host phases of a B16 x 8k decode step (profile_generate.py --phases) for kvquant and
# transformers' default, the 4-bit decode kernels against FP8 per-tensor, and the capacity
# with FP8 per-tensor and NVFP4 pages (8k prompts, 24 GiB, prefill_chunk_size 2048).
# Usage (device tool, repo root):  bash benchmarks/step_round.sh
#   timeouts (s): KERNEL_TIMEOUT, FP4_TIMEOUT, HF_TIMEOUT, PHASES_TIMEOUT, BENCH_TIMEOUT,
#   E2E_TIMEOUT, CAPACITY_TIMEOUT; BENCH_CONFIGS: 4-bit tile overrides for bench_fp4_decode.py --configs;
#   PARTS=tests,hf,phases,bench,e2e,capacity (the default: all) picks parts, to split it over calls;
#   hf: every GPU test of tests/hf; e2e: the B16 x 8k decode with FP8 and NVFP4 pages
# Writes under $OUT: env.log, gpu_tests.log, gpu_tests_fp4.log, gpu_tests_hf.log,
#   phases_b16x8k.txt, fp4_decode.json, e2e_b16x8k.json, capacity_fp4.json
set -u
OUT=${OUT:-./step_round_out}
. "$(dirname "$0")/round_env.sh"
PARTS=${PARTS:-tests,hf,phases,bench,e2e,capacity}
part() { [[ ",$PARTS," == *",$1,"* ]]; }
fp4=(tests/kernels/test_write_fp4.py tests/kernels/test_attention_fp4.py tests/kernels/test_fp4_codec.py
     tests/kernels/test_fp4_triton.py tests/kernels/test_k_transform_fp4.py tests/cache/test_storage_fp4.py
     tests/schemes/test_schemes.py tests/hf/test_hf_fp4.py tests/hf/test_hf_fp4_rotation.py
     tests/kernels/test_k_transform_fp4_keys.py tests/cache/test_storage_k_transform_fp4.py
     tests/hf/test_hf_k_transform_fp4_keys.py tests/kernels/test_k_transform.py
     tests/kernels/test_group_rotation.py tests/kernels/test_write.py)
part tests && timeout "${KERNEL_TIMEOUT:-170}" python3 -m pytest -q -rfE --tb=short --show-capture=no -m gpu -n 8 --dist load \
  tests/gpu tests/kernels -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
part tests && tail -n 2 "$OUT/gpu_tests.log"
part tests && timeout "${FP4_TIMEOUT:-100}" python3 -m pytest -q -rfE --tb=short --show-capture=no -n 8 --dist load "${fp4[@]}" \
  -p no:cacheprovider > "$OUT/gpu_tests_fp4.log" 2>&1
part tests && tail -n 2 "$OUT/gpu_tests_fp4.log"
part hf && timeout "${HF_TIMEOUT:-200}" python3 -m pytest -q -rfE --tb=short --show-capture=no -m gpu \
  -n 8 --dist load tests/hf -p no:cacheprovider > "$OUT/gpu_tests_hf.log" 2>&1
part hf && tail -n 2 "$OUT/gpu_tests_hf.log"
part phases && timeout "${PHASES_TIMEOUT:-100}" python3 benchmarks/profile_generate.py --batch 16 --prompt 8192 \
  --new 64 --phases --arms kvquant,default --out "$OUT/phases_b16x8k.txt" 2>&1 | grep "^==="
part bench && timeout "${BENCH_TIMEOUT:-70}" python3 benchmarks/bench_fp4_decode.py --shapes 32x16384 \
  ${BENCH_CONFIGS:+--configs "$BENCH_CONFIGS"} --out "$OUT/fp4_decode.json" 2>&1 | tail -n 8
part e2e && timeout "${E2E_TIMEOUT:-130}" python3 benchmarks/e2e_generate.py --shapes b16x8k \
  --arms kvquant,kvquant-nvfp4 --repeats 2 --out "$OUT/e2e_b16x8k.json" 2>&1 | tail -n 4
part capacity && timeout "${CAPACITY_TIMEOUT:-400}" python3 benchmarks/e2e_generate.py --capacity --budget-gb 24 \
  --capacity-start 150 --no-capacity-unchunked --capacity-arms kvquant,kvquant-nvfp4 \
  --out "$OUT/capacity_fp4.json" 2>&1 | tail -n 4

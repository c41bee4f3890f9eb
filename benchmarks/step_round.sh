#!/usr/bin/env bash
# One H200 round for the decode step's time and the 4-bit pages, in one device call:
# the 4-bit tests with full tracebacks, the host phases of a B16 x 8k decode step
# (profile_generate.py --phases) for kvquant and transformers' default, the 4-bit decode
# kernels against FP8 per-tensor, and the chat shape's phases beside the compiled static cache.
# Usage (device tool, repo root):  bash benchmarks/step_round.sh
#   timeouts (s): FP4_TIMEOUT, PHASES_TIMEOUT, BENCH_TIMEOUT, CHAT_TIMEOUT
# Writes under $OUT: env.log, gpu_tests_fp4.log, phases_b16x8k.txt, fp4_decode.json,
#   phases_chat.txt
set -u
OUT=${OUT:-./step_round_out}
. "$(dirname "$0")/round_env.sh"
fp4=(tests/kernels/test_write_fp4.py tests/kernels/test_attention_fp4.py tests/kernels/test_fp4_codec.py
     tests/kernels/test_fp4_triton.py tests/test_cache_fp4.py tests/test_schemes.py tests/hf/test_hf_fp4.py)
timeout "${FP4_TIMEOUT:-120}" python3 -m pytest -q -rfE --tb=short --show-capture=no -n 4 "${fp4[@]}" \
  -p no:cacheprovider > "$OUT/gpu_tests_fp4.log" 2>&1
tail -n 2 "$OUT/gpu_tests_fp4.log"
timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/bench_fp4_decode.py --out "$OUT/fp4_decode.json" \
  2>&1 | tail -n 6
timeout "${PHASES_TIMEOUT:-120}" python3 benchmarks/profile_generate.py --batch 16 --prompt 8192 \
  --new 64 --phases --arms kvquant,default --out "$OUT/phases_b16x8k.txt" 2>&1 | grep "^===" 
timeout "${CHAT_TIMEOUT:-90}" python3 benchmarks/profile_generate.py --batch 1 --prompt 512 \
  --new 64 --phases --arms kvquant,static --out "$OUT/phases_chat.txt" 2>&1 | grep "^==="

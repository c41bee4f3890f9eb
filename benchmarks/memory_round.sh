#!/usr/bin/env bash
# One H200 round of the memory work, as users meet it (no collection between calls): the
# capacity search with default arguments (per-tensor scales and no scales, with and without
# prefill_chunk_size), then B16 x 8k and the chat shape (second-call peaks, memory left
# after remove(), decode and prefill times). Usage (device tool, repo root):
#   bash benchmarks/memory_round.sh [capacity] [b16x8k] [chat] [tests]
# Writes under $OUT: env.log, e2e_capacity.json, e2e_<shape>.json, e2e.log, gpu_tests_hf.log
set -u
OUT=${OUT:-./memory_round_out}
. "$(dirname "$0")/round_env.sh"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(capacity b16x8k chat)
for p in "${parts[@]}"; do
  case "$p" in
    capacity)
      timeout "${CAP_TIMEOUT:-330}" python3 benchmarks/e2e_generate.py --capacity --budget-gb 24 \
        --capacity-start 64 --out "$OUT/e2e_capacity.json" 2>&1 | tee -a "$OUT/e2e.log" \
        | grep -E '^(capacity|  )' ;;
    b16x8k)
      timeout "${SHAPE_TIMEOUT:-200}" python3 benchmarks/e2e_generate.py --shapes b16x8k \
        --arms default,kvquant,kvquant-fp32-group --out "$OUT/e2e_b16x8k.json" 2>&1 \
        | tee -a "$OUT/e2e.log" | grep -vE '^ *(arm|shape) ' ;;
    chat)
      timeout "${SHAPE_TIMEOUT:-200}" python3 benchmarks/e2e_generate.py --shapes chat \
        --arms default,static,kvquant,kvquant-fp32-group --out "$OUT/e2e_chat.json" 2>&1 \
        | tee -a "$OUT/e2e.log" | grep -vE '^ *(arm|shape) ' ;;
    tests)
      timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu tests/hf -p no:cacheprovider \
        2>&1 | tail -n 60 > "$OUT/gpu_tests_hf.log"
      tail -n 6 "$OUT/gpu_tests_hf.log" ;;
  esac
done

#!/usr/bin/env bash
# One H200 round for the default ring of each sequence's 16 newest tokens (recent_tokens="auto"):
# every GPU test on the new default, then the end-to-end figures README and docs/performance.md
# quote "with every option at its default", each shape beside the same arm without the ring
# (kvquant-recent0), and the capacity search with the defaults.
# Parts (PARTS, default "tests b16x8k"; each part fits one 10-minute device call):
#   tests:  pytest -m gpu tests (8 workers on the one GPU);
#   b16x8k: 16 x (8192 + 64): default, kvquant, kvquant-fp32-group, kvquant-recent0;
#   chat:   1 x (512 + 256): default, static, kvquant, kvquant-fp32-group, kvquant-recent0;
#   b64x2k: 64 x (2048 + 64): default, static, kvquant, kvquant-recent0;
#   capacity: the largest batch of 8192-token prompts in 24 GiB, defaults: one prefill, then
#          prefill_chunk_size=2048 (each arm's result written as it ends), default, kvquant,
#          kvquant-fp32-group;
#   cb:     continuous batching, quick workload: sdpa, kvquant-dynamic (no ring, the default
#          there), kvquant-recent16 (the decode path: benchmarks/cb_graphs_round.sh, on 5.24).
# Usage (device tool, repo root): PARTS="tests b16x8k" bash benchmarks/ring_default_round.sh
# Writes under $OUT: env.log, gpu_tests_all.log, e2e_<shape>.json, e2e_capacity.json,
# cb_quick.json
set -u
OUT=${OUT:-./ring_default_round_out}
PARTS=${PARTS:-tests b16x8k}
. "$(dirname "$0")/round_env.sh"
shape() {
  timeout "${SHAPE_TIMEOUT:-240}" python3 benchmarks/e2e_generate.py --shapes "$1" --arms "$2" \
    --out "$OUT/e2e_$1.json" 2>&1 | tee -a "$OUT/e2e.log" | grep -vE '^ *(arm|shape) '
}
for part in $PARTS; do
  case $part in
    tests)
      start=$(date +%s)
      timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -q -rfEs --tb=short --show-capture=no \
        -m gpu -n 8 --dist load -p no:cacheprovider tests > "$OUT/gpu_tests_all.log" 2>&1
      echo "rc=$? wall_s=$(( $(date +%s) - start ))" >> "$OUT/gpu_tests_all.log"
      tail -n 3 "$OUT/gpu_tests_all.log"
      ;;
    b16x8k) shape b16x8k default,kvquant,kvquant-fp32-group,kvquant-recent0 ;;
    chat) shape chat default,static,kvquant,kvquant-fp32-group,kvquant-recent0 ;;
    b64x2k) shape b64x2k default,static,kvquant,kvquant-recent0 ;;
    capacity)
      timeout "${CAP_TIMEOUT:-330}" python3 benchmarks/e2e_generate.py --capacity --budget-gb 24 \
        --capacity-start 64 \
        --capacity-arms default,kvquant,kvquant-fp32-group --out "$OUT/e2e_capacity.json" 2>&1 \
        | tee -a "$OUT/e2e.log" | grep -E '^(capacity|  )'
      ;;
    cb)
      timeout "${CB_TIMEOUT:-240}" python3 benchmarks/continuous_batching.py --quick \
        --arms sdpa,kvquant-dynamic,kvquant-recent16 --out "$OUT/cb_quick.json" 2>&1 \
        | tee -a "$OUT/cb.log" | grep -E '^(arm|  )'
      ;;
    *) echo "unknown part $part (tests, b16x8k, chat, b64x2k, capacity, cb)" ;;
  esac
done

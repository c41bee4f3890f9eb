#!/usr/bin/env bash
# One H200 round of continuous batching on kvquant's FP8 pages: the GPU tests of the batching
# cache, then benchmarks/continuous_batching.py (one process per arm), quick first.
# Usage (device tool, repo root):  bash benchmarks/cb_round.sh [quick] [medium] [full] [full40]
#   quick:  32 requests (prompts 256-1024, 32-64 new), a 0.25 GiB cache budget (~2 min)
#   medium: 96 requests (prompts 256-4096, 64-256 new), a 2 GiB budget, sdpa and kvquant (~4 min)
#   full:   256 requests (prompts 256-8192, 128-512 new), a 16 GiB cache budget
#   full40: the full workload with a 40 GiB budget
# CB_ARMS=a,b,... picks the arms of every run (e.g. sdpa,kvquant-dynamic,kvquant-nvfp4,kvquant-recent16).
# Writes under $OUT: env.log, gpu_tests_cb.log, cb_<name>.json, cb.log
set -u
OUT=${OUT:-./cb_round_out}
. "$(dirname "$0")/round_env.sh"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu tests/hf/test_hf_continuous_batching.py \
    -p no:cacheprovider 2>&1 | tail -n 60 > "$OUT/gpu_tests_cb.log"
  tail -n 4 "$OUT/gpu_tests_cb.log"
fi
runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(quick)
for r in "${runs[@]}"; do
  case "$r" in
    quick) args=(--quick) ;;
    medium) args=(--arms sdpa,kvquant --requests 96 --prompt 256,4096 --new 64,256 --budget-gb 2) ;;
    full) args=(--budget-gb 16) ;;
    full40) args=(--budget-gb 40) ;;
    *) echo "unknown run $r"; continue ;;
  esac
  [ -n "${CB_ARMS:-}" ] && args+=(--arms "$CB_ARMS")
  timeout "${RUN_TIMEOUT:-580}" python3 benchmarks/continuous_batching.py "${args[@]}" \
    --out "$OUT/cb_$r.json" 2>&1 | tee -a "$OUT/cb.log" | grep -E '^(arm|  )'
done

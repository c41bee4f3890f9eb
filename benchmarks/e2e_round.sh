#!/usr/bin/env bash
# One H200 round of the end-to-end work: the HF-integration GPU tests, then e2e_generate.py,
# one process per shape (allocators apart). Usage (device tool, repo root):
#   bash benchmarks/e2e_round.sh [shapes...]      (default: b16x8k chat b64x2k)
#   "first": the chat shape's first call, one process and fresh compile caches per arm
#   "rowgroups": prefill_tokens' GPU tests, B16 x 8k with kvquant-rowgroups beside the default
#   and kvquant (its prefill time), and the chunked capacity search of the three arms
# Writes under $OUT: env.log, gpu_tests_hf.log, e2e_<shape>.json, e2e.log
set -u
OUT=${OUT:-./e2e_round_out}
. "$(dirname "$0")/round_env.sh"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu tests/hf -p no:cacheprovider 2>&1 \
    | tail -n 60 > "$OUT/gpu_tests_hf.log"
  tail -n 4 "$OUT/gpu_tests_hf.log"
fi
shapes=("$@")
[ ${#shapes[@]} -eq 0 ] && shapes=(b16x8k chat b64x2k)
for s in "${shapes[@]}"; do
  if [ "$s" = sweeps ]; then
    timeout "${SWEEP_TIMEOUT:-240}" python3 benchmarks/e2e_generate.py --shapes batch,context \
      --repeats 1 --out "$OUT/e2e_sweeps.json" 2>&1 | tee -a "$OUT/e2e.log" | tail -n 2
  elif [ "$s" = first ]; then
    for a in static kvquant kvquant-nocompile; do
      TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) \
        timeout "${SHAPE_TIMEOUT:-240}" python3 benchmarks/e2e_generate.py --shapes chat \
        --arms "$a" --repeats 1 --out "$OUT/e2e_first_$a.json" 2>&1 | tee -a "$OUT/e2e.log" \
        | grep -vE '^ *(arm|shape) '
    done
  elif [ "$s" = profile ]; then
    timeout 150 python3 benchmarks/profile_generate.py --batch 1 --prompt 512 --new 64 \
      --arms default,kvquant,kvquant-eager --out "$OUT/profile_chat.txt" 2>&1 | tail -n 4
  elif [ "$s" = probe ]; then
    timeout 120 python3 benchmarks/memory_probe.py --batch 40 --out "$OUT/memory_probe.json" \
      2>&1 | tee -a "$OUT/e2e.log" | tail -n 40
  elif [ "$s" = rowgroups ]; then
    timeout 120 python3 -m pytest -q -m gpu tests/hf/test_hf_row_groups_gpu.py -p no:cacheprovider \
      2>&1 | tail -n 40 > "$OUT/gpu_tests_rowgroups.log"
    tail -n 3 "$OUT/gpu_tests_rowgroups.log"
    timeout "${SHAPE_TIMEOUT:-240}" python3 benchmarks/e2e_generate.py --shapes b16x8k \
      --arms default,kvquant,kvquant-rowgroups --out "$OUT/e2e_b16x8k_rowgroups.json" 2>&1 \
      | tee -a "$OUT/e2e.log" | grep -vE '^ *(arm|shape) '
    timeout "${CAP_TIMEOUT:-300}" python3 benchmarks/e2e_generate.py --capacity --budget-gb 24 \
      --no-capacity-unchunked --capacity-start 32 --capacity-arms default,kvquant,kvquant-rowgroups \
      --out "$OUT/e2e_capacity_rowgroups.json" 2>&1 | tee -a "$OUT/e2e.log" | grep -E '^(capacity|  )'
  elif [ "$s" = capacity ]; then
    timeout "${CAP_TIMEOUT:-300}" python3 benchmarks/e2e_generate.py --capacity --budget-gb 24 \
      --out "$OUT/e2e_capacity.json" 2>&1 | tee -a "$OUT/e2e.log" | grep -E '^(capacity|  )'
  else
    timeout "${SHAPE_TIMEOUT:-240}" python3 benchmarks/e2e_generate.py --shapes "$s" \
      --out "$OUT/e2e_$s.json" 2>&1 | tee -a "$OUT/e2e.log" | grep -vE '^ *(arm|shape) '
  fi
done

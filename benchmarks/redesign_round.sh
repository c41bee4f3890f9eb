#!/usr/bin/env bash
# One H200 round after a reorganisation: every GPU test, then the end-to-end decode and prefill
# of the reorganised tree beside a tree of the revision before it, in one session.
# Usage (device tool, repo root):  BEFORE=<commit> bash benchmarks/redesign_round.sh [shapes...]
#   BEFORE: a commit whose tree was unpacked into ./bench_before (git archive, untracked)
#   shapes: e2e_generate.py shapes (default: b16x8k chat)
#   ARMS (this tree; default: default,kvquant,kvquant-fp32-group), ARMS_BEFORE (default: kvquant,kvquant-fp32-group)
# Writes under $OUT: env.log, gpu_tests.log, gpu_tests_hf.log, e2e_<shape>_{before,after}.json
set -u
OUT=${OUT:-./redesign_round_out}
. "$(dirname "$0")/round_env.sh"
dirs=()
for d in tests/gpu tests/kernels; do [ -d "$d" ] && dirs+=("$d"); done
timeout "${KERNEL_TIMEOUT:-200}" python3 -m pytest -q -rfE -m gpu -n 8 "${dirs[@]}" \
  -p no:cacheprovider 2>&1 | tail -n 80 > "$OUT/gpu_tests.log"
tail -n 3 "$OUT/gpu_tests.log"
# the 4-bit kernels' tests run on the GPU when there is one (not marked gpu: they run on CPU too)
fp4=(tests/kernels/test_fp4_codec.py tests/kernels/test_fp4_triton.py tests/kernels/test_write_fp4.py)
timeout "${FP4_TIMEOUT:-120}" python3 -m pytest -q -rfE -n 4 "${fp4[@]}" -p no:cacheprovider \
  2>&1 | tail -n 40 > "$OUT/gpu_tests_fp4.log"
tail -n 2 "$OUT/gpu_tests_fp4.log"
timeout "${HF_TIMEOUT:-240}" python3 -m pytest -q -rfE -m gpu -n 4 tests/hf -p no:cacheprovider \
  2>&1 | tail -n 150 > "$OUT/gpu_tests_hf.log"
tail -n 3 "$OUT/gpu_tests_hf.log"
shapes=("$@")
[ ${#shapes[@]} -eq 0 ] && shapes=(b16x8k chat)
for s in "${shapes[@]}"; do
  for tree in after before; do
    dir=.
    arms=${ARMS:-default,kvquant,kvquant-fp32-group}
    [ "$tree" = before ] && dir=bench_before && arms=${ARMS_BEFORE:-kvquant,kvquant-fp32-group}
    [ -d "$dir" ] || { echo "no $dir"; continue; }
    (cd "$dir" && PYTHONPATH=. timeout "${SHAPE_TIMEOUT:-150}" python3 benchmarks/e2e_generate.py \
      --shapes "$s" --arms "$arms" --repeats 2 \
      --out "$OUT/e2e_${s}_${tree}.json" 2>&1 | tail -n 6)
  done
done

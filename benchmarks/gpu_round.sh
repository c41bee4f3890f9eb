#!/usr/bin/env bash
# One H200 round: GPU tests (attention + everyone's `pytest -m gpu`) and the attention benchmark.
# Usage (device tool, repo root): bash benchmarks/gpu_round.sh [bench args, e.g. --quick]
# Writes under $OUT: env.log, gpu_tests_attention.log, gpu_tests_all.log, bench.log,
# attention.json, attention.png
set -u
OUT=${OUT:-./gpu_round_out}
. "$(dirname "$0")/round_env.sh"
timeout 140 python3 -m pytest -q -m gpu -n 8 tests/gpu/test_attention_gpu.py -p no:cacheprovider \
  2>&1 | tail -n 80 > "$OUT/gpu_tests_attention.log"
tail -n 5 "$OUT/gpu_tests_attention.log"
timeout 180 python3 -m pytest -q -m gpu tests/ --ignore=tests/gpu/test_attention_gpu.py \
  -p no:cacheprovider 2>&1 | tail -n 80 > "$OUT/gpu_tests_all.log"
tail -n 5 "$OUT/gpu_tests_all.log"
timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/bench_attention.py --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/bench.log" | grep -v '^{'

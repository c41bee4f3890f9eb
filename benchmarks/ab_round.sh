#!/usr/bin/env bash
# One H200 round comparing this tree's B16 x 8k decode with an earlier kvquant, in one device call:
# the GPU tests of the decode graphs, the host phases of a decode step (this tree), then the
# e2e decode alternating this tree and the earlier one (twice each, kvquant arm only).
# Prepare the earlier tree first (ignored by git: name it in the device tool's carry, ["_prev"]):
#   rm -rf _prev && mkdir _prev && git archive <rev> kvquant | tar -x -C _prev
# Usage (device tool, repo root):  bash benchmarks/ab_round.sh
# Writes under $OUT: env.log, gpu_tests_graphs.log, phases_b16x8k.txt,
#   e2e_b16x8k_after_{1,2}.json (this tree), e2e_b16x8k_before_{1,2}.json (_prev)
set -u
OUT=${OUT:-./ab_round_out}
. "$(dirname "$0")/round_env.sh"
timeout 150 python3 -m pytest -q -rfE --tb=short --show-capture=no -m gpu tests/hf/test_hf_graphs.py \
  tests/hf/test_hf_cache_fastpaths.py tests/cache/test_book.py -p no:cacheprovider \
  > "$OUT/gpu_tests_graphs.log" 2>&1
tail -n 3 "$OUT/gpu_tests_graphs.log"
timeout 100 python3 benchmarks/profile_generate.py --batch 16 --prompt 8192 --new 64 --phases --arms kvquant \
  --out "$OUT/phases_b16x8k.txt" 2>&1 | grep "^==="
for i in 1 2; do
  timeout 110 python3 benchmarks/e2e_generate.py --shapes b16x8k --arms kvquant --repeats 3 \
    --out "$OUT/e2e_b16x8k_after_$i.json" 2>&1 | tail -n 2
  PYTHONPATH=_prev:. timeout 110 python3 benchmarks/e2e_generate.py --shapes b16x8k --arms kvquant \
    --repeats 3 --out "$OUT/e2e_b16x8k_before_$i.json" 2>&1 | tail -n 2
done

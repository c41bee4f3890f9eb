#!/usr/bin/env bash
# One H200 round of continuous batching on transformers 5.24 (the image has 5.17, which has no
# decode path): the GPU tests of tests/hf on 5.24 (the batching decode path, its padded steps and
# decode steps replayed from CUDA graphs among them), then the quick batching workload with and
# without decode graphs.
# Needs the transformers 5.24.0 wheel in .whl/ (ignored by git), carried with the call:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl transformers==5.24.0
# (its other needs are in the image). Device tool: carry [".whl"], then
#   PARTS="tests cb" bash benchmarks/cb_graphs_round.sh
# Parts (PARTS, default "tests cb"; each fits one 10-minute device call):
#   tests: pytest -m gpu tests/hf on transformers 5.24 (8 workers on the one GPU);
#   cb:    benchmarks/continuous_batching.py --quick, arms sdpa and kvquant-dynamic (decode
#          steps on transformers' decode path), then kvquant-dynamic with
#          --max-blocks-per-request 0 (every step planned on the host, as on 5.17), then
#          kvquant-dynamic with --decode-graphs (use_cuda_graph=(False, True)).
# Writes under $OUT: env.log, gpu_tests_hf_524.log, cb_quick_524.json,
# cb_quick_524_hostplan.json, cb_quick_524_graphs.json
set -u
OUT=${OUT:-./cb_graphs_round_out}
PARTS=${PARTS:-tests cb}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/transformers-5.24.0-*.whl || exit 1
. "$(dirname "$0")/round_env.sh"
export PYTHONPATH=/tmp/site:.
python3 -c 'import transformers; print("transformers", transformers.__version__)' | tee -a "$OUT/env.log"
for part in $PARTS; do
  case $part in
    tests)
      start=$(date +%s)
      timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -q -rfEs --tb=short --show-capture=no \
        -m gpu -n 8 --dist load -p no:cacheprovider tests/hf > "$OUT/gpu_tests_hf_524.log" 2>&1
      echo "rc=$? wall_s=$(( $(date +%s) - start ))" >> "$OUT/gpu_tests_hf_524.log"
      tail -n 3 "$OUT/gpu_tests_hf_524.log"
      ;;
    cb)
      timeout "${CB_TIMEOUT:-240}" python3 benchmarks/continuous_batching.py --quick \
        --arms sdpa,kvquant-dynamic --out "$OUT/cb_quick_524.json" 2>&1 \
        | tee -a "$OUT/cb.log" | grep -E '^(arm|  )'
      timeout "${CB_TIMEOUT:-240}" python3 benchmarks/continuous_batching.py --quick \
        --arms kvquant-dynamic --max-blocks-per-request 0 --out "$OUT/cb_quick_524_hostplan.json" \
        2>&1 | tee -a "$OUT/cb.log" | grep -E '^(arm|  )'
      timeout "${CB_TIMEOUT:-240}" python3 benchmarks/continuous_batching.py --quick \
        --arms kvquant-dynamic --decode-graphs --out "$OUT/cb_quick_524_graphs.json" 2>&1 \
        | tee -a "$OUT/cb.log" | grep -E '^(arm|  )'
      ;;
    *) echo "unknown part $part (tests, cb)" ;;
  esac
done

#!/usr/bin/env bash
# One H200 round comparing this tree's decode with an earlier kvquant's, in one device call.
# Prepare the earlier tree first (ignored by git: name it in the device tool's carry, ["_prev"]):
#   rm -rf _prev && mkdir _prev && git archive <rev> kvquant | tar -x -C _prev
# Parts (PARTS, comma-separated, default tests,write,tune,e2e):
#   tests  the write kernels' tests on CUDA and the decode-graph GPU tests
#   write  one decode step's write in isolation (bench_attention --only-write), after and before
#   tune   the decode split/tile sweep of Llama-3.2-1B's B16 x 8k and B64 x 2k (graph replay)
#   kt     the k-transform beside per-head scales (bench_attention --only-kt), after and before
#   fp4    decode over 4-bit pages beside FP8 (bench_fp4_decode, B32 x 16k and B16 x 8k), after
#          and before
#   e2e    the e2e decode step, after / before alternating (E2E_ROUNDS times), arms E2E_ARMS
#          (default kvquant,kvquant-nvfp4) at shapes E2E_SHAPES (default b16x8k,b64x2k)
# Usage (device tool, repo root):  PARTS=tests,write,tune bash benchmarks/decode_ab_round.sh
set -u
OUT=${OUT:-./decode_ab_out}
PARTS=${PARTS:-tests,write,tune,e2e}
E2E_ROUNDS=${E2E_ROUNDS:-1}
E2E_ARMS=${E2E_ARMS:-kvquant,kvquant-nvfp4}
E2E_SHAPES=${E2E_SHAPES:-b16x8k,b64x2k}
. "$(dirname "$0")/round_env.sh"
has() { [[ ",$PARTS," == *",$1,"* ]]; }
if has tests; then
  python3 -c 'import flash_attn; print("flash_attn", flash_attn.__version__)' >> "$OUT/env.log" 2>&1 \
    || echo "flash_attn: not installed" >> "$OUT/env.log"
  timeout 200 python3 -m pytest -q -rfE --tb=short --show-capture=no -n 8 --dist load \
    tests/kernels/test_write.py tests/kernels/test_write_fp4.py tests/hf/test_hf_graphs.py \
    -p no:cacheprovider > "$OUT/gpu_tests_write.log" 2>&1
  tail -n 3 "$OUT/gpu_tests_write.log"
fi
if has write; then
  timeout 100 python3 benchmarks/bench_attention.py --only-write --out "$OUT/write_after" 2>&1 | tail -n 3
  PYTHONPATH=_prev:. timeout 100 python3 benchmarks/bench_attention.py --only-write \
    --out "$OUT/write_before" 2>&1 | tail -n 3
fi
if has tune; then
  timeout 150 python3 benchmarks/tune_decode.py --graph --budget-s 120 \
    --shapes 32/8/64/16/8192/per-tensor,32/8/64/64/2048/per-tensor --out "$OUT/tune" 2>&1 \
    | grep '"best"' | cut -c1-400
fi
if has kt; then
  timeout 120 python3 benchmarks/bench_attention.py --only-kt --out "$OUT/kt_after" 2>&1 \
    | grep "^k-transform"
  PYTHONPATH=_prev:. timeout 120 python3 benchmarks/bench_attention.py --only-kt \
    --out "$OUT/kt_before" 2>&1 | grep "^k-transform"
fi
if has fp4; then
  timeout 150 python3 benchmarks/bench_fp4_decode.py --out "$OUT/fp4_after.json" 2>&1 | tail -n 12
  PYTHONPATH=_prev:. timeout 150 python3 benchmarks/bench_fp4_decode.py \
    --out "$OUT/fp4_before.json" 2>&1 | tail -n 12
fi
if has e2e; then
  for i in $(seq 1 "$E2E_ROUNDS"); do
    timeout 200 python3 benchmarks/e2e_generate.py --shapes "$E2E_SHAPES" --arms "$E2E_ARMS" \
      --repeats 3 --out "$OUT/e2e_after_$i.json" 2>&1 | tail -n 2
    PYTHONPATH=_prev:. timeout 200 python3 benchmarks/e2e_generate.py --shapes "$E2E_SHAPES" \
      --arms "$E2E_ARMS" --repeats 3 --out "$OUT/e2e_before_$i.json" 2>&1 | tail -n 2
  done
fi

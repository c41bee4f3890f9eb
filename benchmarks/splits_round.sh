#!/usr/bin/env bash
# One H200 round on the decode kernel's split count where a cache meets it: the launcher sizes
# the split count from the block table's width, and a cache whose pools grew with headroom
# before its decode graph was captured has tables about 1.5x the length it holds (B64 x 2k:
# 193 pages for about 2100 keys). Before the two-wave bound (06db936) the rule gave NVFP4 17
# splits at that width where the kernel benchmark's exact tables got 3, and jumped between 2
# and 55 for neighbouring widths (offline; docs/dev/kernels.md, "Split count at a cache's
# table widths"). This round times the launcher's counts (now bounded) against forced ones.
# Parts (PARTS, default "sweep shapes kt"):
#   sweep: the attention alone at the e2e geometries with the launcher's split count and forced
#          ones, with and without a ring of 16 (bench_fp4_decode.py --table-pages --splits);
#   shapes: forced split counts at the kernel tables' shapes (32/8/128 B32 x 16k, B8 x 1k,
#          B1 x 32k): whether fewer splits than the wave rule's do as well wherever the
#          (sequence, KV head) pairs alone already fill the GPU's bandwidth;
#   kt:    forced split counts for per-head and the k-transform at the shapes where the
#          k-transform costs most (9/3/64 and 32/8/128 B16 x 8k, 9/3/64 B32 x 16k): each program
#          pays the transform's prologue once, so fewer, longer splits may close the gap;
#   e2e:   the B64 x 2k decode step, fp32-group with and without recent_tokens=16, both orders,
#          each arm's decode launches (split counts) recorded in its JSON;
#   profile: the kernels of both arms' B64 x 2k steps (profile_generate.py --kernels).
# Usage (device tool, repo root): PARTS="sweep shapes kt" bash benchmarks/splits_round.sh
# Then, anywhere: python benchmarks/split_rules.py OUT/splits_*.json OUT/kt/tune.json ranks the
# launcher's split counts and candidate rules' against the best forced ones.
# Writes under $OUT: env.log, splits_b64.json, splits_b16.json, splits_shapes.json,
# kt/tune.json, e2e_b64_{ab,ba}.json, profile_b64.txt
set -u
OUT=${OUT:-./splits_round_out}
PARTS=${PARTS:-sweep shapes kt}
. "$(dirname "$0")/round_env.sh"
for part in $PARTS; do
  case $part in
    sweep)
      # B64 x 2080 keys in a 193-page table (the e2e's after its headroom growth), then
      # B16 x 8224 keys in a 769-page table; Llama-3.2-1B heads
      timeout 240 python3 benchmarks/bench_fp4_decode.py --heads 32,8,64 \
        --formats fp8,fp8-group,nvfp4 --recent 16 --shapes 64x2080 --table-pages 193 \
        --splits 1,2,3,4,6,8,12,17 --out "$OUT/splits_b64.json" 2>&1 | tail -n 2
      timeout 200 python3 benchmarks/bench_fp4_decode.py --heads 32,8,64 \
        --formats fp8,fp8-group,nvfp4 --recent 16 --shapes 16x8224 --table-pages 769 \
        --splits 1,2,3,4,6,8,12 --out "$OUT/splits_b16.json" 2>&1 | tail -n 2
      ;;
    shapes)
      timeout 300 python3 benchmarks/bench_fp4_decode.py --heads 32,8,128 --formats fp8,fp8-group \
        --shapes 32x16384,8x1024,1x32768 --splits 1,2,4,8,16,32 \
        --out "$OUT/splits_shapes.json" 2>&1 | tail -n 3
      ;;
    kt)
      timeout 300 python3 benchmarks/tune_decode.py --graph --no-configs --budget-s 280 \
        --shapes 9/3/64/16/8192/per-head+per-head-kt,32/8/128/16/8192/per-head+per-head-kt,9/3/64/32/16384/per-head+per-head-kt \
        --out "$OUT/kt" 2>&1 | grep -v '^{"shape".*"fmt"' | tail -n 2
      ;;
    e2e)
      timeout 200 python3 benchmarks/e2e_generate.py --shapes b64x2k --repeats 3 \
        --arms kvquant-fp32-group,kvquant-recent0 --out "$OUT/e2e_b64_ab.json" 2>&1 | tail -n 6
      timeout 200 python3 benchmarks/e2e_generate.py --shapes b64x2k --repeats 3 \
        --arms kvquant-recent0,kvquant-fp32-group --out "$OUT/e2e_b64_ba.json" 2>&1 | tail -n 6
      ;;
    profile)
      timeout 200 python3 benchmarks/profile_generate.py --batch 64 --prompt 2048 --new 32 \
        --kernels --arms kvquant-fp32-group,kvquant-recent0 --out "$OUT/profile_b64.txt" 2>&1 |
        tail -n 3
      ;;
    *)
      echo "unknown part $part (sweep, shapes, kt, e2e, profile)"
      ;;
  esac
done

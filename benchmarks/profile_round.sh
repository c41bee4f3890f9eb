#!/usr/bin/env bash
# One H200 round: where a B16 x 8k decode step's time goes (CUDA's timeline), and the decode
# and prefill of this tree against an earlier kvquant, alternating in one device call.
# Prepare the earlier tree first (ignored by git: name it in the device tool's carry, ["_prev"]):
#   rm -rf _prev && mkdir _prev && git archive <rev> kvquant | tar -x -C _prev
# Usage (device tool, repo root):  bash benchmarks/profile_round.sh
#   SHAPES (default "b16x8k chat"), ARMS (default kvquant,kvquant-fp32-group), TIMELINE=0 skips
#   the profiles, AB=0 the A/B, CAPACITY="<arm>:<first batch> ..." adds a chunked capacity
#   search of 8k prompts in 24 GiB per arm (e.g. "kvquant:150 kvquant-mxfp4:270").
# Writes under $OUT (the device tool brings back 8 files at most): env.log,
#   timeline_b16x8k.txt, timeline_b16x8k_stack.txt (Python functions on the host's path between
#   two replays; profiler overhead included), capacity_<arm>.json, e2e_<shape>_{after,before}_<i>.json
set -u
OUT=${OUT:-./profile_round_out}
. "$(dirname "$0")/round_env.sh"
if [ "${TIMELINE:-1}" = 1 ]; then
  timeout 120 python3 benchmarks/profile_generate.py --batch 16 --prompt 8192 --new 32 --timeline \
    --arms kvquant --out "$OUT/timeline_b16x8k.txt" 2>&1 | grep -v "^USDT" | tail -n 2
  timeout 150 python3 benchmarks/profile_generate.py --batch 16 --prompt 8192 --new 16 --timeline \
    --stack --arms kvquant --out "$OUT/timeline_b16x8k_stack.txt" 2>&1 | grep -v "^USDT" | tail -n 2
fi
for spec in ${CAPACITY:-}; do
  timeout "${CAPACITY_TIMEOUT:-200}" python3 benchmarks/e2e_generate.py --capacity --budget-gb 24 \
    --no-capacity-unchunked --capacity-arms "${spec%%:*}" --capacity-start "${spec##*:}" \
    --out "$OUT/capacity_${spec%%:*}.json" 2>&1 | grep "^capacity"
done
[ "${AB:-1}" = 1 ] || exit 0
[ -d _prev ] || { echo "no _prev: the A/B part is skipped"; exit 0; }
for s in ${SHAPES:-b16x8k chat}; do
  for i in 1 2; do
    timeout 150 python3 benchmarks/e2e_generate.py --shapes "$s" \
      --arms "${ARMS:-kvquant,kvquant-fp32-group}" --repeats 3 \
      --out "$OUT/e2e_${s}_after_$i.json" 2>&1 | tail -n 3
    PYTHONPATH=_prev:. timeout 150 python3 benchmarks/e2e_generate.py --shapes "$s" \
      --arms "${ARMS:-kvquant,kvquant-fp32-group}" --repeats 3 \
      --out "$OUT/e2e_${s}_before_$i.json" 2>&1 | tail -n 3
  done
done

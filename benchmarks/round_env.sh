# The environment header of every H200 round (sourced by gpu_round.sh and e2e_round.sh):
# $OUT (created), PYTHONPATH and unbuffered output, and $OUT/env.log with the card and versions.
OUT=${OUT:-./round_out}
mkdir -p "$OUT"
export PYTHONPATH=.
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
} 2>&1 | tee "$OUT/env.log"

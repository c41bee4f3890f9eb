"""One attention launch inside an NVTX range named ``prof``, for Nsight Compute (H200).

Builds the problem of ``bench_attention.py`` (random bf16 K/V quantized into pages of 16
behind a shuffled block table, V pages keys-fastest as the cache stores them), warms the
kernel up, then launches it once inside the range, so that ``ncu --nvtx --nvtx-include
"prof/"`` profiles exactly that launch (and the split reduction, if any).

Usage (H200, repository root)::

    ncu --clock-control none --nvtx --nvtx-include "prof/" \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \\
        python3 benchmarks/ncu_arm.py --lq 2048 --batch 4 --ctx 10240 --format group64

``--contiguous-v`` gives the kernel token-major V pages instead (the layout before V was
stored keys-fastest), to compare the two through the same kernel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_attention as ba


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument(
        "--ctx", type=int, default=16384, help="keys per sequence, the new ones included"
    )
    ap.add_argument("--lq", type=int, default=1, help="new query tokens per sequence")
    ap.add_argument("--heads", default="32/8/128", help="Hq/Hkv/D")
    ap.add_argument(
        "--format", default="per-tensor", help="per-tensor, per-head, group64, group128"
    )
    ap.add_argument("--contiguous-v", action="store_true", help="token-major V pages")
    args = ap.parse_args()
    hq, hkv, d = (int(x) for x in args.heads.split("/"))
    p = ba.Problem(args.batch, args.ctx, hq, hkv, d, lq=args.lq)
    f = p.fmt(args.format)
    if args.contiguous_v:
        f["v_pages"] = f["v_pages"].contiguous()
    for _ in range(2):  # compile and warm up outside the range
        ba.run_kvquant(p, f, p.q)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("prof")
    ba.run_kvquant(p, f, p.q)
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

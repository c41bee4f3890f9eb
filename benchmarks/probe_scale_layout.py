"""Probe: folded decode with fp32 group scales laid out slot-major vs head-major (H200).

The attention kernel takes the group scales' page, slot and head strides as arguments.
The cache stores them head-major (:func:`kvquant.kernels.group_scale_storage`: one
contiguous run of scales per (page, head), viewed in the canonical shape
``[num_pages, page_size, Hkv, D // G]``); ``.contiguous()`` gives the slot-major order
that the cache used before. B32 x 16k, 32/8/128, CUDA-graph replay
(``bench_attention.bench_graph``), two alternating repetitions; the outputs of the two
layouts must be bit-identical. Prints one JSON object (microseconds).

Usage (H200): ``PYTHONPATH=. python3 benchmarks/probe_scale_layout.py``
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_attention as ba
import tune_decode as td

import kvquant.kernels.attention.launch as at


def main() -> None:
    p = ba.Problem(32, 16384, 32, 8, 128)
    res: dict[str, float | bool] = {"sdpa": ba.bench_graph(ba.decode_sdpa(p)) * 1e3}
    for fmt in ["group128", "group64"]:
        hm = p.fmt(fmt)  # the cache's layout (kvquant.kernels.group_scale_storage)
        sm = dict(hm)
        for k in ("k_group_scales", "v_group_scales"):
            sm[k] = hm[k].contiguous()
        res[fmt + "_same"] = bool(torch.equal(td.launch(at, p, sm), td.launch(at, p, hm)))
        for rep in range(2):
            for name, ff in (("slot_major", sm), ("head_major", hm)):
                call = functools.partial(td.launch, at, p, ff)
                res[f"{fmt}_{name}_{rep}"] = ba.bench_graph(call) * 1e3
        print(json.dumps(res), flush=True)
    call = functools.partial(td.launch, at, p, p.fmt("per-tensor"))
    res["per-tensor"] = ba.bench_graph(call) * 1e3
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()

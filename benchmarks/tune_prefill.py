"""Prefill tuning sweep: tile configurations of a chunk over a paged prefix, beside SDPA.

For each chunk-over-prefix shape (32 query / 8 KV heads) and format, every ``(BLOCK_M, BLOCK_N, num_warps,
num_stages, LOOP_STAGES)`` configuration is checked against the fp32 reference first
(NaN-poisoned output), then timed; SDPA bf16 over the same contiguous K/V with the lower-right
causal mask (FlashAttention-2 on the H200) is timed in the same process. Prints each shape's
best configuration and its ratio to SDPA, writes everything to ``--out/tune_prefill.json``.

Usage (H200)::

    PYTHONPATH=. python3 benchmarks/tune_prefill.py --out results/
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_attention as ba

# (B, prefix, chunk, head_dim, formats)
SHAPES: list[tuple[int, int, int, int, list[str]]] = [
    (4, 8192, 2048, 128, ["per-tensor", "group64"]),
    (8, 2048, 512, 128, ["per-tensor"]),
    (1, 32768, 4096, 128, ["per-tensor"]),
]
# --quick: static scales only, head_dim 128 and 64 (Llama-3.2-1B's), short shapes first
QUICK_SHAPES: list[tuple[int, int, int, int, list[str]]] = [
    (8, 2048, 512, 128, ["per-tensor"]),
    (4, 8192, 2048, 64, ["per-tensor"]),
    (4, 8192, 2048, 128, ["per-tensor"]),
    (1, 32768, 4096, 128, ["per-tensor"]),
]
# BLOCK_M, BLOCK_N, num_warps, num_stages, LOOP_STAGES (the first is the launcher's default
# for static scales)
CONFIGS: list[tuple[int, int, int, int, int]] = [
    (128, 64, 4, 2, 3),
    (128, 64, 4, 3, 3),
    (128, 64, 4, 2, 4),
    (128, 64, 8, 2, 3),
    (128, 128, 8, 2, 3),
    (128, 128, 8, 3, 3),
    (128, 128, 8, 2, 4),
    (256, 64, 8, 2, 3),
    (256, 128, 8, 2, 3),
    (64, 64, 4, 2, 3),
    (64, 128, 4, 2, 3),
]
# --quick: the static-scale defaults (128 rows on 4 warps, 256 rows on 8) and their neighbours
QUICK_CONFIGS = [(128, 64, 4, 2, 3), (256, 64, 8, 2, 3), (256, 64, 8, 3, 3), (256, 128, 8, 2, 3)]


def tune_shape(
    bsz: int,
    prefix: int,
    chunk: int,
    d: int,
    formats: list[str],
    configs: list[Any],
    smoke: bool,
) -> dict[str, Any]:
    """Every configuration of one shape and its formats, SDPA beside them; best printed."""
    from torch.nn.attention.bias import causal_lower_right

    hq, hkv = 32, 8
    group = hq // hkv
    ctx = prefix + chunk
    p = ba.Problem(bsz, ctx, hq, hkv, d, lq=chunk)
    flops = 4 * hq * d * (chunk * prefix + chunk * (chunk + 1) // 2) * bsz
    row: dict[str, Any] = {"B": bsz, "prefix": prefix, "chunk": chunk, "head_dim": d}
    row["TFLOP"] = flops / 1e12
    if not smoke:
        q = p.q.transpose(1, 2).contiguous()
        k = p.k.transpose(1, 2).repeat_interleave(group, dim=1).contiguous()
        v = p.v.transpose(1, 2).repeat_interleave(group, dim=1).contiguous()
        mask = causal_lower_right(chunk, ctx)
        row["sdpa_ms"] = ba.bench(
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=p.sm_scale)
        )
        del q, k, v
    for name in formats:
        f = p.fmt(name)
        runs: dict[str, Any] = {}
        for bm, bn, nw, ns, ls in configs:
            cfg = {"BLOCK_M": bm, "QPB": bm // group, "BLOCK_N": bn, "num_warps": nw}
            cfg.update({"num_stages": ns, "LOOP_STAGES": ls})
            key = f"{bm}/{bn}/{nw}/{ns}/{ls}"
            try:
                err = ba.check(p, f, p.q, config=cfg)
                t = ba.bench(lambda cfg=cfg, f=f: ba.run_kvquant(p, f, p.q, config=cfg))
            except Exception as exc:  # a configuration that does not compile or fit
                runs[key] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
                continue
            runs[key] = {"ms": t, "rel_err": err}
            if "sdpa_ms" in row:
                runs[key]["speed_vs_sdpa"] = row["sdpa_ms"] / t
        row[name] = runs
        ok = {k: r for k, r in runs.items() if "ms" in r and r["rel_err"] <= ba.REL_TOL}
        if ok:
            best = min(ok, key=lambda k: ok[k]["ms"])
            line = f"B{bsz} {prefix}+{chunk} d{d} {name}: best {best} {ok[best]['ms']:.3f} ms"
            first = next(iter(runs))
            if "ms" in runs[first]:
                line += f" (default {first} {runs[first]['ms']:.3f} ms)"
            if "sdpa_ms" in row:
                line += f", sdpa {row['sdpa_ms']:.3f} ms = {row['sdpa_ms'] / ok[best]['ms']:.3f}x"
            print(line, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting shapes after")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, one tiny shape")
    ap.add_argument("--quick", action="store_true", help="only QUICK_CONFIGS")
    args = ap.parse_args()
    shapes, configs = (QUICK_SHAPES, QUICK_CONFIGS) if args.quick else (SHAPES, CONFIGS)
    if args.smoke:
        ba.DEV, ba.SMOKE = "cpu", True
        shapes, configs = [(1, 64, 64, 64, ["per-tensor"])], CONFIGS[:2]
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.budget_s
    rows: list[dict[str, Any]] = []
    for bsz, prefix, chunk, d, formats in shapes:
        if time.time() > deadline:
            print(f"skipped B{bsz} {prefix}+{chunk} d{d}: time budget", flush=True)
            continue
        rows.append(tune_shape(bsz, prefix, chunk, d, formats, configs, args.smoke))
        (args.out / "tune_prefill.json").write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()

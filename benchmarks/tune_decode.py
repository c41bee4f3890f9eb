"""Decode tuning sweep: tile configurations x split counts per shape, side by side with SDPA.

For each decode shape and format, every ``(BLOCK_N, num_warps, num_stages)`` configuration
runs with the launcher's own split choice and with forced split counts; each run is checked
against the fp32 reference first (NaN-poisoned output), then timed. SDPA over a contiguous
bf16 cache of the same shape is timed in the same process, and ``--baseline`` names another
copy of the launcher module (``kvquant/kernels/attention/launch.py``) to time beside the
current one. A copy of today's launcher imports kvquant's current kernels, so to time a kernel
change give a copy that defines its kernels itself (e.g. one from before they moved apart).
Prints the best configuration per shape and writes everything to ``--out/tune.json``.

``--graph`` times CUDA-graph replays (device time without host gaps), ``--auto-splits``
keeps only the launcher's split choice, ``--no-configs`` only the launcher's tile (the split
counts swept alone), ``--shapes`` names the shapes (``Hq/Hkv/D/B/ctx/FMT``, comma-separated)
instead of :data:`SHAPES`.

Usage (H200)::

    PYTHONPATH=. python3 benchmarks/tune_decode.py --out results/ [--baseline old.py]
    PYTHONPATH=. python3 benchmarks/tune_decode.py --out results/ --graph --auto-splits
    PYTHONPATH=. python3 benchmarks/tune_decode.py --out results/ --graph --no-configs \
        --shapes 9/3/64/16/8192/per-head+per-head-kt
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_attention as ba

# (hq, hkv, d, B, ctx, formats)
SHAPES = [
    (32, 8, 128, 32, 16384, ["per-tensor", "group64", "group128"]),
    (32, 8, 128, 1, 32768, ["per-tensor"]),
    (32, 8, 128, 8, 1024, ["per-tensor"]),
    (32, 8, 64, 16, 8192, ["group64"]),
    (9, 3, 64, 32, 16384, ["per-tensor"]),
    (32, 8, 128, 8, 16384, ["per-tensor"]),
]
# tile configurations: BLOCK_N, num_warps, num_stages, LOOP_STAGES (software pipelining depth
# of the key loop; indirect loads feeding a dot get LOOP_STAGES - 3 prefetch buffers)
CONFIGS: list[tuple[Any, ...]] = [
    (64, 2, 3, 6),
    (64, 2, 3, 5),
    (64, 2, 3, 4),
    (64, 2, 3, 3),
    (128, 4, 3, 5),
    (128, 4, 3, 6),
    (64, 4, 3, 6),
    (128, 2, 3, 5),
    (128, 4, 2, 2),
]
SPLITS: list[int | None] = [None, 1, 2, 4, 8, 16, 32]


@triton.jit
def _stream_kernel(
    k_ptr, v_ptr, bt_ptr, out_ptr, n_keys, s_p, s_t, s_h, s_bt,
    BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, PAGE: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Read one (sequence, KV head)'s paged K and V like the attention kernel; sum them."""
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_D)
    acc = tl.zeros([BLOCK_N, HEAD_D], tl.float32)
    for n0 in tl.range(0, n_keys, BLOCK_N, num_stages=STAGES):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        page = tl.load(bt_ptr + b.to(tl.int64) * s_bt + offs_n // PAGE).to(tl.int64)
        row = page * s_p + (offs_n % PAGE) * s_t + kvh * s_h
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :])
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :])
        acc += k.to(tl.float32) + v.to(tl.float32)
    total = tl.sum(tl.sum(acc, 1), 0)
    tl.store(out_ptr + b * tl.num_programs(0) + kvh, total)


def stream_probe(p: ba.Problem, head_major: bool, block_n: int, warps: int, stages: int) -> float:
    """TB/s of :func:`_stream_kernel` over ``p``'s pages (``head_major``: ``[P, Hkv, page, D]``)."""
    f = p.fmt("per-tensor")
    k, v = f["k_pages"], f["v_pages"].contiguous()  # both token-major, like K
    if head_major:
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        s_p, s_h, s_t = k.stride(0), k.stride(1), k.stride(2)
    else:
        s_p, s_t, s_h = k.stride(0), k.stride(1), k.stride(2)
    out = torch.empty(p.bsz * p.hkv, device=k.device)

    def call() -> None:
        _stream_kernel[(p.hkv, p.bsz)](
            k, v, p.block_tables, out, p.ctx, s_p, s_t, s_h, p.block_tables.stride(0),
            BLOCK_N=block_n, HEAD_D=p.d, PAGE=p.page, STAGES=stages, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip

    t = ba.bench(call)
    return p.payload_bytes(1) / t / 1e9


def current_module() -> Any:
    """kvquant's attention module (imported lazily, after ``--smoke`` set the device)."""
    import kvquant.kernels.attention.launch as current

    return current


def load_module(path: Path) -> Any:
    """Import a copy of ``attention_triton.py`` under a private name."""
    spec = importlib.util.spec_from_file_location("kvq_baseline_attention", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def launch(mod: Any, p: ba.Problem, f: dict[str, Any], **kw: Any) -> torch.Tensor:
    """One call of ``mod.paged_attention_triton`` on problem ``p`` in format ``f``.

    The baseline module must take the kernels' objects (``Pages``, a scheme, ``Mask``): a
    launcher from before kvquant.schemes does not.
    """
    x = ba.kernel_inputs(f, kw)
    return mod.paged_attention_triton(
        p.q, x["pages"], p.block_tables, p.seq_lens, x["scheme"], sm_scale=p.sm_scale,
        mask=x["mask"], first=x["first"], **kw,
    )  # fmt: skip


def launcher_splits(mod: Any, p: ba.Problem, f: dict[str, Any], cfg: dict[str, int]) -> int:
    """The split count ``mod``'s launcher chooses for problem ``p`` in format ``f``."""
    x = ba.kernel_inputs(f, {})
    return int(
        mod.attention_launch(
            p.q, x["pages"], p.block_tables, p.seq_lens, x["scheme"], sm_scale=p.sm_scale,
            mask=x["mask"], first=x["first"], config=cfg or None,
        ).num_splits
    )  # fmt: skip


def _parse_shape(text: str) -> tuple[Any, ...]:
    """``Hq/Hkv/D/B/ctx/FMT[+FMT...]`` -> a :data:`SHAPES` entry."""
    *dims, formats = text.split("/")
    if len(dims) != 5:
        raise SystemExit(f"--shapes: {text!r}; expected Hq/Hkv/D/B/ctx/FMT[+FMT...]")
    return (*(int(x) for x in dims), formats.split("+"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--baseline", type=Path, default=None)
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--stream", action="store_true", help="also time a read-only page stream")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    ap.add_argument(
        "--graph",
        action="store_true",
        help="time CUDA-graph replays (device time, no host gaps, no L2 flush) instead of calls",
    )
    ap.add_argument(
        "--auto-splits", action="store_true", help="only the launcher's own split count"
    )
    ap.add_argument(
        "--no-configs",
        action="store_true",
        help="only the launcher's own tile configuration (sweep the split counts alone)",
    )
    ap.add_argument(
        "--shapes",
        default=None,
        help="comma-separated Hq/Hkv/D/B/ctx/FMT[+FMT...] instead of SHAPES, "
        "e.g. 32/8/64/16/8192/per-tensor",
    )
    args = ap.parse_args()
    global SHAPES, CONFIGS, SPLITS
    if args.shapes:
        SHAPES = [_parse_shape(s) for s in args.shapes.split(",")]
    if args.smoke:
        ba.DEV, ba.SMOKE = "cpu", True
        SHAPES = [(8, 2, 64, 2, 256, ["per-tensor", "group64"])]
        CONFIGS, SPLITS = [(32, 4, 2, 3)], [None, 2]
    if args.auto_splits:
        SPLITS = [None]
    if args.no_configs:
        CONFIGS = []
    timer = ba.bench_graph if args.graph and not args.smoke else ba.bench
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.budget_s
    impls = {"current": current_module()}
    if args.baseline is not None:
        impls["baseline"] = load_module(args.baseline)
    results: dict[str, Any] = {
        "bandwidth": ba.probe_bandwidth(),
        "timing": "cuda-graph replay" if timer is not ba.bench else "do_bench, L2 flushed",
        "shapes": [],
    }
    print(json.dumps(results["bandwidth"]), flush=True)
    for hq, hkv, d, bsz, ctx, formats in SHAPES:
        p = ba.Problem(bsz, ctx, hq, hkv, d)
        row: dict[str, Any] = {"shape": f"{hq}/{hkv}/{d} B{bsz}x{ctx}"}
        if args.stream and bsz * ctx >= 1 << 18:
            row["stream_TBps"] = {
                f"{'head_major' if hm else 'token_major'}/{bn}/{nw}/{ns}": stream_probe(
                    p, hm, bn, nw, ns
                )
                for hm in (False, True)
                for bn, nw, ns in ((128, 4, 2), (128, 4, 3), (128, 4, 4), (128, 8, 3), (64, 4, 4))
            }
            print(json.dumps({"shape": row["shape"], "stream_TBps": row["stream_TBps"]}))
        row["sdpa_ms"] = timer(ba.decode_sdpa(p))
        for name in formats:
            f = p.fmt(name)
            nbytes = p.payload_bytes(1) + p.scale_bytes(name) + p.block_tables.numel() * 4
            runs = []
            for impl_name, mod in impls.items():
                for conf in [(None,), *CONFIGS] if impl_name == "current" else [(None,)]:
                    cfg: dict[str, int] = {}
                    if conf[0] is not None:
                        bn, nw, ns, ls = conf
                        cfg = {"BLOCK_N": bn, "num_warps": nw, "num_stages": ns, "LOOP_STAGES": ls}
                    for s in SPLITS if impl_name == "current" else [None]:
                        if time.time() > deadline:
                            break
                        if s is not None and bsz * hkv * s > 8 * 132 * 4:
                            continue
                        kw: dict[str, Any] = {"config": cfg} if cfg else {}
                        if s is not None:
                            kw["num_splits"] = s

                        call = functools.partial(launch, mod, p, f, **kw)

                        try:
                            out = torch.full_like(p.q, float("nan"))
                            launch(mod, p, f, **kw, out=out)
                            ok = not bool(torch.isnan(out).any())
                            t = timer(call) if ok else float("nan")
                        except Exception as err:  # a configuration may fail to compile
                            runs.append({"impl": impl_name, "config": cfg, "splits": s,
                                         "error": str(err)[:200]})  # fmt: skip
                            continue
                        runs.append({
                            "impl": impl_name, "config": cfg, "splits": s, "ms": t,
                            "TBps": nbytes / t / 1e9, "vs_sdpa": row["sdpa_ms"] / t,
                        })  # fmt: skip
                        if s is None and hasattr(mod, "attention_launch"):
                            runs[-1]["launcher_splits"] = launcher_splits(mod, p, f, cfg)
            err = ba.check(p, f, p.q)
            good = [r for r in runs if "ms" in r and r["ms"] == r["ms"]]
            best = min(good, key=lambda r: r["ms"]) if good else None
            auto = [
                r
                for r in good
                if r["impl"] == "current" and not r["config"] and r["splits"] is None
            ]
            base = [r for r in good if r["impl"] == "baseline"]
            row[name] = {
                "rel_err_default": err,
                "best": best,
                "default": auto[:1],
                "baseline": base[:1],
                "runs": runs,
            }
            print(json.dumps({"shape": row["shape"], "fmt": name, "sdpa_ms": row["sdpa_ms"],
                              "best": best, "default": auto[:1], "baseline": base[:1]}), flush=True)  # fmt: skip
            del f
        results["shapes"].append(row)
        (args.out / "tune.json").write_text(json.dumps(results, indent=1))
        del p
        if ba.DEV == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

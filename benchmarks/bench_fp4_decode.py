"""Decode attention over 4-bit pages against FP8 per-tensor pages, on one GPU.

For each shape (32 query / 8 KV heads, head_dim 128 by default) the same random bf16 K/V are
written through ``kvquant.kernels.write_kv`` into shuffled pages of each format: ``fp8``
(per-tensor static scales), ``nvfp4`` (global scale amax / 2688), ``mxfp4`` and
``fp8-k-nvfp4-v`` (``--formats`` also takes ``fp8-group``, dynamic fp32 scales per group of 64
channels, the format of a model without scales). Each format's Triton decode is first checked against the pure-PyTorch
reference over the same pages (NaN-filled output), then timed: the median of
``triton.testing.do_bench`` (eager, L2 flushed) and of a CUDA-graph replay. The JSON gives the
time, the bytes read (pages, block scales, block table) per second, and each format's time
and bytes as a fraction of FP8's. ``--configs`` also times the 4-bit formats under other tile
configurations (``BLOCK_N,num_warps,LOOP_STAGES`` overrides of the launcher's choice), each
checked against the reference too, under ``configs`` in each format's entry: candidates
compared in one run. ``--recent R`` times each format again with a ring of each sequence's
``R`` newest tokens in bf16 (``recent_tokens``), checked against the reference with the same
ring, under ``recent`` (with ``graph_ms_x_plain``, its time over the format's without it).
Every entry records the split count the launcher chose (``launcher_splits``), and on a GPU each
row the registers, warps and shared memory of every split-kernel variant compiled so far
(``split_kernel_use``: what the launcher's residency, and so its split count, came from). ``--table-pages N``
gives each sequence's block table ``N`` columns (at least the context's pages; the columns past
it point at a spare page the kernel never reads), as a cache whose pools grew with headroom
before its decode graph was captured holds them: the launcher sizes its split count from the
table's width. ``--splits`` also times each format (and its ring) with forced split counts,
under ``splits``, each checked against the reference first.

Usage::

    PYTHONPATH=. python benchmarks/bench_fp4_decode.py --out fp4_decode.json [--shapes 32x16384,16x8192]
    PYTHONPATH=. python benchmarks/bench_fp4_decode.py --out x.json --shapes 32x16384 --configs "64,2,3;32,1,6"
    PYTHONPATH=. python benchmarks/bench_fp4_decode.py --out x.json --formats fp8,fp8-group,nvfp4 --recent 16
    PYTHONPATH=. python benchmarks/bench_fp4_decode.py --out x.json --heads 32,8,64 --shapes 64x2080 \
        --table-pages 193 --splits 1,2,3,5,8,17
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/bench_fp4_decode.py --out x.json --smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from kvquant.kernels import group_scale_storage, page_storage, paged_attention, write_kv
from kvquant.kernels.attention import launch as attention_launcher
from kvquant.kernels.attention.launch import attention_launch, paged_attention_triton
from kvquant.kernels.fp4 import fp4_page_storage
from kvquant.schemes import (
    Fp8KNvfp4VScales,
    GroupScales,
    Mxfp4Scales,
    Nvfp4Scales,
    Pages,
    PerTensorScales,
    RecentTokens,
    Scheme,
)

FORMATS = ("fp8", "nvfp4", "mxfp4", "fp8-k-nvfp4-v")
EXTRA_FORMATS = ("fp8-group",)
REL_TOL = 2e-2  # bf16 queries and output against the fp32 reference


def _scheme(name: str, d: int, k_amax: torch.Tensor, v_amax: torch.Tensor) -> Scheme:
    if name == "fp8":
        return PerTensorScales(k_amax / 448, v_amax / 448)
    if name == "nvfp4":
        return Nvfp4Scales(d, k_amax / 2688, v_amax / 2688)
    if name == "mxfp4":
        return Mxfp4Scales(d)
    if name == "fp8-group":
        return GroupScales(d, 64 if d % 64 == 0 else d)
    return Fp8KNvfp4VScales(d, k_amax / 448, v_amax / 2688)


def _pages(scheme: Scheme, num_pages: int, page: int, hkv: int, d: int, dev: str) -> Pages:
    view = scheme.kernel_view()
    k8, v8 = page_storage(num_pages, page, hkv, d, device=dev)
    if view.group_size is not None:
        ng = d // view.group_size
        ks = group_scale_storage(num_pages, page, hkv, ng, device=dev)
        return Pages(k8, v8, ks, group_scale_storage(num_pages, page, hkv, ng, device=dev))
    sides: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for fmt, fp8_pages in ((view.k_fp4, k8), (view.v_fp4, v8)):
        if fmt is None:
            sides.append((fp8_pages, None))
        else:
            sides.append(fp4_page_storage(num_pages, page, hkv, d, fmt, device=dev))
    (kp, ks), (vp, vs) = sides
    return Pages(kp, vp, ks, vs)


def _read_bytes(pages: Pages, used_pages: int, num_pages: int, table: torch.Tensor) -> int:
    """Bytes of the pages (and block scales) the sequences use, and of the block table."""
    total = table.numel() * table.element_size()
    for t in (pages.k, pages.v, pages.k_scales, pages.v_scales):
        if t is not None:
            total += t.numel() * t.element_size() * used_pages // num_pages
    return total


def _config(spec: str) -> dict[str, int]:
    """``"BLOCK_N,num_warps,LOOP_STAGES"`` as the launcher's ``config=`` overrides."""
    block_n, warps, stages = (int(x) for x in spec.split(","))
    return {"BLOCK_N": block_n, "num_warps": warps, "LOOP_STAGES": stages}


def _timed(call: Any, smoke: bool, nbytes: int) -> dict[str, float]:
    if smoke:
        return {}
    import triton.testing

    ms = float(triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median"))
    graph_ms = float(triton.testing.do_bench_cudagraph(call, rep=100, return_mode="median"))
    return {"ms": ms, "graph_ms": graph_ms, "TBps": nbytes / ms / 1e9}


def _rel_err(out: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    if not err <= REL_TOL:  # NaN fails too
        raise SystemExit(f"{what}: relative error {err} against the reference")
    return err


def _splits_timed(
    call: Any, out: torch.Tensor, ref: torch.Tensor, splits: tuple[int, ...], smoke: bool,
    nbytes: int, what: str,
) -> dict[str, Any]:  # fmt: skip
    """``call(num_splits=s)`` for each forced split count: checked against ``ref``, then timed."""
    timed: dict[str, Any] = {}
    for s in splits:

        def forced(s: int = s) -> Any:
            return call(num_splits=s)

        out.fill_(float("nan"))
        forced()
        err = _rel_err(out, ref, f"{what} splits {s}")
        timed[str(s)] = {"rel_err": err, **_timed(forced, smoke, nbytes)}
    return timed


def split_kernel_use() -> list[dict[str, Any]]:
    """Registers, warps and shared memory of each split decode kernel the launcher compiled
    (its residency's inputs), with the variant's constexprs and pointer dtypes."""
    out = []
    for key, (regs, warps, shared) in attention_launcher._KERNEL_USE.items():
        _device, dtypes, *consts = key
        out.append({
            "registers": regs, "warps": warps, "shared_bytes": shared,
            "consts": {str(k): v for k, v in consts if isinstance(v, (bool, int, float, str))},
            "pointers": [None if t is None else str(t) for t in dtypes],
        })  # fmt: skip
    return out


def run_shape(
    bsz: int, ctx: int, hq: int, hkv: int, d: int, page: int, dev: str, smoke: bool,
    configs: tuple[str, ...] = (), formats: tuple[str, ...] = FORMATS, recent: int = 0,
    table_pages: int = 0, splits: tuple[int, ...] = (),
) -> dict[str, Any]:  # fmt: skip
    gen = torch.Generator(device="cpu").manual_seed(0)
    per_seq = -(-ctx // page)
    if table_pages and table_pages < per_seq:
        raise SystemExit(f"--table-pages {table_pages}: fewer than the {per_seq} pages of {ctx}")
    num_pages = bsz * per_seq + 1
    perm = torch.randperm(num_pages, generator=gen)
    table = perm[: bsz * per_seq].view(bsz, per_seq)
    if table_pages > per_seq:  # columns past the context: the spare page, never read
        spare = perm[-1:].expand(bsz, table_pages - per_seq)
        table = torch.cat([table, spare], dim=1)
    table = table.to(torch.int32).contiguous().to(dev)
    pos = torch.arange(ctx)
    slots = (table.long().cpu()[:, pos // page] * page + pos % page).to(dev)
    gain = torch.linspace(0.5, 3.0, hkv).view(1, 1, hkv, 1).to(dev)
    key = (torch.randn(bsz, ctx, hkv, d, generator=gen).to(dev) * gain).to(torch.bfloat16)
    value = (torch.randn(bsz, ctx, hkv, d, generator=gen).to(dev) * gain.flip(2)).to(torch.bfloat16)
    k_amax, v_amax = key.float().abs().amax(), value.float().abs().amax()
    qdtype = torch.bfloat16 if dev == "cuda" else torch.float16  # interpreter: no bf16 tl.dot
    query = torch.randn(bsz, 1, hq, d, generator=gen).to(dev).to(qdtype)
    seq_lens = torch.full((bsz,), ctx, dtype=torch.int32, device=dev)
    sm = d**-0.5
    row: dict[str, Any] = {
        "B": bsz, "ctx": ctx, "hq": hq, "hkv": hkv, "d": d, "page": page,
        "table_pages": int(table.shape[1]),
    }  # fmt: skip
    ring = None
    if recent:  # position p of a sequence in slot p % R, as the cache keeps them
        ring = torch.empty(bsz, 2, recent, hkv, d, dtype=torch.bfloat16, device=dev)
        newest = torch.arange(max(0, ctx - recent), ctx, device=dev)
        ring[:, 0, newest % recent] = key[:, newest]
        ring[:, 1, newest % recent] = value[:, newest]
        row["recent"] = recent
    for name in formats:
        scheme = _scheme(name, d, k_amax, v_amax).to(dev)
        pages = _pages(scheme, num_pages, page, hkv, d, dev)
        for b0 in range(0, bsz, 4):  # a few sequences per write: bounded temporaries
            b1 = min(bsz, b0 + 4)
            write_kv(key[b0:b1], value[b0:b1], pages, slots[b0:b1], scheme, backend="triton")
        out = torch.full_like(query, float("nan"))

        def call(pages: Pages = pages, scheme: Scheme = scheme, out: torch.Tensor = out) -> Any:
            return paged_attention(
                query, pages, table, seq_lens, scheme, sm_scale=sm, out=out, backend="triton"
            )

        call()
        ref = paged_attention(query, pages, table, seq_lens, scheme, sm_scale=sm, backend="torch")
        err = _rel_err(out, ref, f"{name} B{bsz}x{ctx}")
        nbytes = _read_bytes(pages, bsz * per_seq, num_pages, table)
        entry: dict[str, Any] = {"rel_err": err, "bytes": nbytes, **_timed(call, smoke, nbytes)}
        entry["launcher_splits"] = attention_launch(
            query, pages, table, seq_lens, scheme, sm_scale=sm, out=out
        ).num_splits

        def call_split(
            num_splits: int, pages: Pages = pages, scheme: Scheme = scheme,
            out: torch.Tensor = out, recent: RecentTokens | None = None,
        ) -> Any:  # fmt: skip
            return paged_attention_triton(
                query, pages, table, seq_lens, scheme, sm_scale=sm, out=out,
                num_splits=num_splits, recent=recent,
            )  # fmt: skip

        if splits:
            entry["splits"] = _splits_timed(
                call_split, out, ref, splits, smoke, nbytes, f"{name} B{bsz}x{ctx}"
            )
        if name != "fp8" and configs:
            entry["configs"] = {}
            for spec in configs:
                tiles = _config(spec)

                def call_cfg(
                    pages: Pages = pages, scheme: Scheme = scheme, out: torch.Tensor = out,
                    cfg: dict[str, int] = tiles,
                ) -> Any:  # fmt: skip
                    return paged_attention_triton(
                        query, pages, table, seq_lens, scheme, sm_scale=sm, out=out, config=cfg
                    )

                out.fill_(float("nan"))
                call_cfg()
                err = _rel_err(out, ref, f"{name} B{bsz}x{ctx} config {spec}")
                entry["configs"][spec] = {"rel_err": err, **_timed(call_cfg, smoke, nbytes)}
        if ring is not None:
            kept = RecentTokens(ring)

            def call_ring(
                pages: Pages = pages, scheme: Scheme = scheme, out: torch.Tensor = out,
                kept: RecentTokens = kept,
            ) -> Any:  # fmt: skip
                return paged_attention(
                    query, pages, table, seq_lens, scheme, sm_scale=sm, out=out,
                    backend="triton", recent=kept,
                )  # fmt: skip

            out.fill_(float("nan"))
            call_ring()
            ref_ring = paged_attention(
                query, pages, table, seq_lens, scheme, sm_scale=sm, backend="torch", recent=kept
            )
            err = _rel_err(out, ref_ring, f"{name} B{bsz}x{ctx} recent {recent}")
            entry["recent"] = {"rel_err": err, **_timed(call_ring, smoke, nbytes)}
            entry["recent"]["launcher_splits"] = attention_launch(
                query, pages, table, seq_lens, scheme, sm_scale=sm, out=out, recent=kept
            ).num_splits
            if splits:

                def ring_split(num_splits: int, kept: RecentTokens = kept) -> Any:
                    return call_split(num_splits, recent=kept)

                entry["recent"]["splits"] = _splits_timed(
                    ring_split, out, ref_ring, splits, smoke, nbytes,
                    f"{name} B{bsz}x{ctx} recent {recent}",
                )  # fmt: skip
            if "graph_ms" in entry:
                entry["recent"]["graph_ms_x_plain"] = (
                    entry["recent"]["graph_ms"] / entry["graph_ms"]
                )
        row[name] = entry
        del pages, out, ref
        if dev == "cuda":
            torch.cuda.empty_cache()
    if dev == "cuda":
        row["split_kernel_use"] = split_kernel_use()
    base = row.get("fp8")
    for name in formats:
        if base is None or name == "fp8":
            continue
        row[name]["bytes_x_fp8"] = row[name]["bytes"] / base["bytes"]
        if "ms" in base:
            for entry in (row[name], *row[name].get("configs", {}).values()):
                entry["ms_x_fp8"] = entry["ms"] / base["ms"]
                entry["graph_ms_x_fp8"] = entry["graph_ms"] / base["graph_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default="32x16384,16x8192", help="comma list of BxCTX")
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head_dim")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shape, no timing")
    ap.add_argument(
        "--configs",
        default="",
        help="';'-separated BLOCK_N,num_warps,LOOP_STAGES tile overrides also timed for 4-bit",
    )
    ap.add_argument(
        "--formats", default=",".join(FORMATS), help=f"comma list of {FORMATS + EXTRA_FORMATS}"
    )
    ap.add_argument("--recent", type=int, default=0, help="also time a ring of R newest tokens")
    ap.add_argument(
        "--table-pages",
        type=int,
        default=0,
        help="block-table columns per sequence (default: the context's pages)",
    )
    ap.add_argument("--splits", default="", help="comma list of split counts also timed (forced)")
    args = ap.parse_args(argv)
    formats = tuple(f for f in args.formats.split(",") if f)
    if not formats or any(f not in FORMATS + EXTRA_FORMATS for f in formats):
        ap.error(f"--formats: {args.formats!r}; expected names from {FORMATS + EXTRA_FORMATS}")
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    splits = tuple(int(x) for x in args.splits.split(",") if x)
    if any(s < 1 for s in splits):
        ap.error(f"--splits: {args.splits!r}; expected positive counts")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        hq, hkv, d, shapes = 4, 2, 32, [(2, 40)]
    result: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/bench_fp4_decode.py", *(argv or sys.argv[1:])]),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if dev == "cuda" else None,
        },
        "rows": [],
    }
    for bsz, ctx in shapes:
        configs = tuple(c for c in args.configs.split(";") if c)
        row = run_shape(
            bsz, ctx, hq, hkv, d, args.page, dev, args.smoke, configs, formats, args.recent,
            args.table_pages, splits,
        )  # fmt: skip
        result["rows"].append(row)
        args.out.write_text(json.dumps(result, indent=1))
        keys = ("ms", "_x_fp8", "TBps", "_x_plain")
        brief = {
            n: {k: round(v, 4) for k, v in row[n].items() if k.endswith(keys)} for n in formats
        }
        for n in formats:
            if "recent" in row[n]:
                brief[f"{n} recent"] = {
                    k: round(v, 4) for k, v in row[n]["recent"].items() if k.endswith(keys)
                }
            for spec, e in row[n].get("configs", {}).items():
                brief[f"{n} {spec}"] = {k: round(v, 4) for k, v in e.items() if k.endswith("ms")}
            for part, e in (("", row[n]), (" recent", row[n].get("recent", {}))):
                if "launcher_splits" in e:
                    brief[f"{n}{part} launcher_splits"] = e["launcher_splits"]
                for s, t in e.get("splits", {}).items():
                    brief[f"{n}{part} splits {s}"] = {
                        k: round(v, 4) for k, v in t.items() if k.endswith("ms")
                    }
        print(f"B{bsz} x {ctx}: {json.dumps(brief)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

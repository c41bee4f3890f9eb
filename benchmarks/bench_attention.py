"""H200 benchmark of kvquant's FP8 paged attention kernels (decode and prefill).

Measures, in one run (notes §6 protocol):

* the card's read bandwidth (a large ``sum``) and copy bandwidth;
* decode: torch SDPA on a contiguous bf16 cache (``enable_gqa``) and kvquant's
  Triton kernel on an FP8 paged cache (shuffled block table) for each format
  (per-tensor, per-head, fp32-group G=64, G=128 and G=32, and ``rotk-group32`` /
  ``rotk-group64``: fp32-group scales of Hadamard-rotated keys), achieved bandwidth =
  (K/V bytes + scale bytes + block-table bytes) / median time;
* split-count and tile sweeps on a few decode shapes;
* prefill/extend: chunk C causal over a paged prefix P vs SDPA (bf16, K/V expanded,
  ``causal_lower_right``), FLOP/s over visible keys only;
* the write kernel for one decode step (B32 x 16k at 32/8/128, B16 x 8k and B64 x 2k at
  32/8/64), when ``kvquant.kernels.write_kv`` exists; ``--only-write`` runs just that section;
* the ``k-transform`` format (``per-head-kt``: per-head scales, K offset, Hadamard rotation
  and one first token from the side buffer) beside ``per-head`` on the same cache: decode
  B32 x 16k and B16 x 8k at 32/8/128 and 9/3/64 (eager and CUDA-graph replay), and chunk
  over prefix prefill; ``--only-kt`` runs just that section; ``--kt-ablation`` adds the
  transform with only some of its parts (rotation, offset, first tokens), each checked and
  printed with its ratio to per-head.

Every configuration is checked against the fp32 reference (on a few sequences,
NaN-poisoned output) before it is timed. Results go to ``--out`` as JSON and PNG.

Usage::

    PYTHONPATH=. python benchmarks/bench_attention.py --out results/ [--quick]
"""

# ruff: noqa: B023, F821  (lambdas are timed immediately, inside their loop iteration)

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing

from kvquant.kernels import group_scale_storage, hadamard, page_storage, paged_attention_reference
from kvquant.kernels.attention.launch import paged_attention_triton
from kvquant.kernels.attention.tuning import choose_config
from kvquant.schemes import (
    FirstTokens,
    GroupScales,
    KTransformScales,
    Mask,
    Pages,
    PerHeadScales,
    PerTensorScales,
    Scheme,
)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
REL_TOL = 5e-3
PAGE = 16
DEV = "cuda"
SMOKE = False  # --smoke: CPU interpreter, tiny shapes, one call per timing (script check only)


def bench(fn: Callable[[], Any]) -> float:
    """Median time of ``fn`` in milliseconds (L2 flushed before each call by do_bench)."""
    if SMOKE:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def bench_graph(fn: Callable[[], Any]) -> float:
    """Median CUDA-graph replay time of ``fn`` in ms (no L2 flush: latency of small work)."""
    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def save(results: dict[str, Any], out: Path) -> None:
    """Write the JSON now (a later timeout keeps what was measured)."""
    (out / "attention.json").write_text(json.dumps(results, indent=1))


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Clamp ``x / scale`` to ±448 and cast to e4m3fn."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class Problem:
    """A paged FP8 cache built from a contiguous bf16 cache, with all scale formats."""

    def __init__(
        self, bsz: int, ctx: int, hq: int, hkv: int, d: int, lq: int = 1, page: int = PAGE
    ) -> None:
        dev = DEV
        self.bsz, self.ctx, self.hq, self.hkv, self.d, self.lq, self.page = (
            bsz,
            ctx,
            hq,
            hkv,
            d,
            lq,
            page,
        )
        self.sm_scale = d**-0.5
        n_pages_seq = ctx // page
        num_pages = bsz * n_pages_seq
        # contiguous bf16 cache [B, L, Hkv, D]; K with per-head spread so per-head scales differ
        head_gain = torch.linspace(0.5, 2.0, hkv, device=dev).view(1, 1, hkv, 1)
        self.k = (torch.randn(bsz, ctx, hkv, d, device=dev) * head_gain).to(torch.bfloat16)
        self.v = torch.randn(bsz, ctx, hkv, d, device=dev, dtype=torch.bfloat16)
        self.q = torch.randn(bsz, lq, hq, d, device=dev, dtype=torch.bfloat16)
        perm = torch.randperm(num_pages, device=dev)
        self.block_tables = perm.view(bsz, n_pages_seq).to(torch.int32).contiguous()
        self.seq_lens = torch.full((bsz,), ctx, dtype=torch.int32, device=dev)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(num_pages, device=dev)
        self._inv = inv  # physical page -> logical (b * n_pages_seq + i)
        self.num_pages = num_pages

    def to_pages(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, L, Hkv, *]`` contiguous -> paged ``[num_pages, P, Hkv, *]`` per the block table."""
        logical = x.reshape(self.num_pages, self.page, *x.shape[2:])
        return logical[self._inv].contiguous()

    def fmt(self, name: str) -> dict[str, Any]:
        """Pages and scales of one format: per-tensor, per-head, per-head-kt, groupG (G = 32,
        64, 128) and rotk-groupG (K rotated by the Hadamard matrix before its groups)."""
        out: dict[str, Any] = {}
        for which, x in (("k", self.k), ("v", self.v)):
            if name.startswith("rotk-") and which == "k":
                out["k_rotation"] = rot = hadamard(self.d, device=x.device)
                x = x.float() @ rot
            if name == "per-head-kt" and which == "k":
                # the k-transform format: K rotated by the Hadamard matrix, offset by its mean,
                # per-head scales; the first token of each sequence kept apart in bf16
                rot = hadamard(self.d, device=x.device)
                rotated = x.float() @ rot
                off = rotated.mean(dim=(0, 1))
                s = (rotated - off).abs().amax(dim=(0, 1, 3)) / FP8_MAX
                pages = self.to_pages(quantize(rotated - off, s.view(1, 1, -1, 1)))
                out.update(k_scale=s.contiguous(), k_offset=off.contiguous(), k_rotation=rot)
                out["first_k"] = rotated[:, :1].to(torch.bfloat16).contiguous()
                out["first_v"] = self.v[:, :1].contiguous()
                out["first_lens"] = torch.ones(self.bsz, dtype=torch.int32, device=x.device)
                del rotated
            elif name == "per-tensor":
                s = (x.float().abs().amax() / FP8_MAX).reshape(())
                pages = self.to_pages(quantize(x, s))
                out[f"{which}_scale"] = s
            elif name in ("per-head", "per-head-kt"):
                s = x.float().abs().amax(dim=(0, 1, 3)) / FP8_MAX
                pages = self.to_pages(quantize(x, s.view(1, 1, -1, 1)))
                out[f"{which}_scale"] = s.contiguous()
            else:
                g = group_size(name)
                xg = x.float().unflatten(-1, (-1, g))
                amax = xg.abs().amax(-1)
                s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
                codes = (xg / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(-2)
                del xg
                pages = self.to_pages(codes)
                paged = self.to_pages(s)
                gs = group_scale_storage(*paged.shape, device=paged.device)  # the cache's layout
                out[f"{which}_group_scales"] = gs.copy_(paged)
            if which == "v":  # the cache's layout: V pages keys-fastest
                _, cache_v = page_storage(*pages.shape, dtype=pages.dtype, device=pages.device)
                pages = cache_v.copy_(pages)
            out[f"{which}_pages"] = pages
        return out

    def scale_bytes(self, name: str) -> int:
        """Bytes of scales read per call."""
        if "group" in name:
            return 2 * self.bsz * self.ctx * self.hkv * (self.d // group_size(name)) * 4
        return 0

    def payload_bytes(self, elem: int) -> int:
        """K+V bytes read per call."""
        return 2 * self.bsz * self.ctx * self.hkv * self.d * elem


def group_size(name: str) -> int:
    """``G`` of a group format's name (``group64``, ``rotk-group32``)."""
    return int(name.removeprefix("rotk-").removeprefix("group"))


KT_KEYS = ("k_offset", "k_rotation", "first_k", "first_v", "first_lens")
_MASK_KEYS = ("causal", "window", "softcap", "kv_start", "q_lens", "sinks")


_SCHEME = "_scheme"
"""Key of a format's scheme in its dict, built by the first :func:`kernel_inputs` call (a
scheme reads its scales on the host when built: not inside a CUDA-graph capture)."""


def kernel_inputs(f: dict[str, Any], kw: dict[str, Any]) -> dict[str, Any]:
    """One format's tensors as the kernels take them: ``pages``, ``scheme``, ``mask``, ``first``.

    Pops the mask's keys from ``kw`` (the rest are the launcher's own: ``out``, ``num_splits``,
    ``config``).
    """
    d = f["k_pages"].shape[-1]
    kg = f.get("k_group_scales")
    pages = Pages(f["k_pages"], f["v_pages"], kg, f.get("v_group_scales"))
    first = FirstTokens(f["first_k"], f["first_v"], f["first_lens"]) if "first_k" in f else None
    mask = Mask(**{k: kw.pop(k) for k in _MASK_KEYS if k in kw})
    if _SCHEME in f:
        return {"pages": pages, "scheme": f[_SCHEME], "mask": mask, "first": first}
    scheme: Scheme
    if kg is not None:
        scheme = GroupScales(d, d // kg.shape[-1], f.get("k_rotation"))
    elif any(k in f for k in KT_KEYS):
        scheme = KTransformScales(
            f["k_scale"], f["v_scale"], f.get("k_offset"), f.get("k_rotation"),
            int(f["first_k"].shape[1]) if "first_k" in f else 0,
        )  # fmt: skip
    elif f["k_scale"].dim():
        scheme = PerHeadScales(f["k_scale"], f["v_scale"])
    else:
        scheme = PerTensorScales(f["k_scale"], f["v_scale"])
    f[_SCHEME] = scheme  # built once: a scheme checks its scales on the host
    return {"pages": pages, "scheme": scheme, "mask": mask, "first": first}


def run_kvquant(p: Problem, f: dict[str, Any], q: torch.Tensor, **kw: Any) -> torch.Tensor:
    """Call the Triton launcher with one format's tensors."""
    x = kernel_inputs(f, kw)
    return paged_attention_triton(
        q, x["pages"], p.block_tables, p.seq_lens, x["scheme"], sm_scale=p.sm_scale,
        mask=x["mask"], first=x["first"], **kw,
    )  # fmt: skip


def check(p: Problem, f: dict[str, Any], q: torch.Tensor, **kw: Any) -> float:
    """Rel. error of the kernel vs the fp32 reference (NaN-poisoned out).

    Checked on up to 3 sequences and their last <= 512 query tokens (query ``i`` sits at
    ``seq_len - q_len + i``, so a suffix of the queries keeps its positions).
    """
    out = torch.full_like(q, float("nan"))
    run_kvquant(p, f, q, out=out, **kw)
    if torch.isnan(out).any():
        return float("nan")
    tail = min(q.shape[1], 512)
    q, out = q[:, -tail:], out[:, -tail:]
    sel = sorted({0, p.bsz // 2, p.bsz - 1})
    n_pg = p.ctx // p.page
    ids = p.block_tables[sel].reshape(-1).long()
    sub_bt = torch.arange(len(sel) * n_pg, device=DEV, dtype=torch.int32).view(len(sel), n_pg)
    sub = {
        k: (v[ids] if k.endswith("pages") or k.endswith("group_scales") else v)
        for k, v in f.items()
    }
    sub.update({k: f[k][sel] for k in ("first_k", "first_v", "first_lens") if k in f})
    x = kernel_inputs(sub, {"causal": kw.get("causal", True)})
    ref = paged_attention_reference(
        q[sel].float(), x["pages"], sub_bt, p.seq_lens[sel], x["scheme"], sm_scale=p.sm_scale,
        mask=x["mask"], first=x["first"],
    )  # fmt: skip
    got = out[sel].float()
    return float((got - ref).norm() / ref.norm())


def probe_bandwidth() -> dict[str, float]:
    """Read-only (sum over 4 GiB) and copy (2 GiB -> 2 GiB) bandwidth in TB/s."""
    n = 1 << (12 if SMOKE else 30)  # 4 GiB fp32
    x = torch.randn(n, device=DEV)
    t_sum = bench(lambda: x.sum())
    y = torch.empty(n // 2, device=DEV)
    xs = x[: n // 2]
    t_copy = bench(lambda: y.copy_(xs))
    res = {
        "read_sum_TBps": x.numel() * 4 / t_sum / 1e9,
        "copy_TBps": 2 * xs.numel() * 4 / t_copy / 1e9,
    }
    del x, y
    return res


def decode_sdpa(p: Problem) -> Callable[[], torch.Tensor]:
    """SDPA on a contiguous bf16 cache: q [B,Hq,1,D], k/v [B,Hkv,L,D], enable_gqa."""
    q = p.q.transpose(1, 2).contiguous()
    k = p.k.transpose(1, 2).contiguous()
    v = p.v.transpose(1, 2).contiguous()
    return lambda: F.scaled_dot_product_attention(q, k, v, scale=p.sm_scale, enable_gqa=True)


def run_decode(
    shapes: list[tuple[int, int, int, int, int]],
    formats: list[str],
    results: dict[str, Any],
    deadline: float,
) -> None:
    """Decode rows: SDPA bf16 and each format, per shape (hq, hkv, d, B, ctx)."""
    for hq, hkv, d, bsz, ctx in shapes:
        if time.time() > deadline:
            results["skipped"].append(f"decode {hq}/{hkv}/{d} B{bsz} ctx{ctx}: time budget")
            continue
        p = Problem(bsz, ctx, hq, hkv, d)
        row: dict[str, Any] = {"hq": hq, "hkv": hkv, "d": d, "B": bsz, "ctx": ctx}
        t = bench(decode_sdpa(p))
        row["sdpa_bf16_ms"] = t
        row["sdpa_bf16_TBps"] = p.payload_bytes(2) / t / 1e9
        for name in formats:
            f = p.fmt(name)
            err = check(p, f, p.q)
            t = bench(lambda f=f: run_kvquant(p, f, p.q))
            nbytes = p.payload_bytes(1) + p.scale_bytes(name) + p.block_tables.numel() * 4
            row[name] = {
                "ms": t,
                "TBps": nbytes / t / 1e9,
                "rel_err": err,
                "speedup_vs_sdpa": row["sdpa_bf16_ms"] / t,
            }
            if name == "per-tensor" and bsz * ctx <= 8 * 4096 and not SMOKE:
                # small work: device time without host launch gaps (inputs stay in L2)
                row["graph_us"] = {
                    "kvquant_per_tensor": 1e3 * bench_graph(lambda f=f: run_kvquant(p, f, p.q)),
                    "sdpa_bf16": 1e3 * bench_graph(decode_sdpa(p)),
                }
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(100):
                    run_kvquant(p, f, p.q)
                row["host_us_per_call"] = (time.perf_counter() - t0) / 100 * 1e6
                torch.cuda.synchronize()
            del f
        results["decode"].append(row)
        print(json.dumps(row), flush=True)
        del p


DECODE_FORMATS = ["per-tensor", "per-head", "group64", "group128", "group32", "rotk-group32"]
EXTRA_FORMATS = ["per-tensor", "group64", "group32", "rotk-group32", "rotk-group64"]
"""Formats of the extra decode shapes (9/3/64: G=64 is one group per head, as Llama-3.2-1B's)."""
PREFILL_FORMATS = ["per-tensor", "group64", "group128", "group32", "rotk-group32"]
SWEEP_SHAPES = [(1, 32768), (8, 16384), (32, 16384), (8, 1024)]
PREFILL_SHAPES = [(4, 8192, 2048), (8, 2048, 512), (1, 32768, 4096)]


def run_sweeps(results: dict[str, Any], deadline: float) -> None:
    """Split-count and tile sweeps (per-tensor, 32/8/128) on a few decode shapes."""
    for bsz, ctx in SWEEP_SHAPES:
        if time.time() > deadline:
            results["skipped"].append(f"sweep B{bsz} ctx{ctx}: time budget")
            continue
        p = Problem(bsz, ctx, 32, 8, 128)
        f = p.fmt("per-tensor")
        nbytes = p.payload_bytes(1)
        row: dict[str, Any] = {"B": bsz, "ctx": ctx, "splits": {}, "tiles": {}}
        for s in (1, 2, 4, 8, 16, 32, 64):
            if bsz * 8 * s > 8 * 132 * 4:
                continue
            t = bench(lambda s=s: run_kvquant(p, f, p.q, num_splits=s))
            row["splits"][str(s)] = {"ms": t, "TBps": nbytes / t / 1e9}
            for bn in (64, 128):
                cfg = {"BLOCK_N": bn}
                t = bench(lambda s=s, cfg=cfg: run_kvquant(p, f, p.q, num_splits=s, config=cfg))
                row["splits"][f"{s}/bn{bn}"] = {"ms": t, "TBps": nbytes / t / 1e9}
        if not SMOKE:
            # host cost of one launcher call (no sync): bounds small-batch latency without graphs
            for _ in range(10):
                run_kvquant(p, f, p.q)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                run_kvquant(p, f, p.q)
            row["host_us_per_call"] = (time.perf_counter() - t0) / 200 * 1e6
            torch.cuda.synchronize()
        variants = [
            (bn, nw, ns)
            for bn in (64, 128, 256)
            for nw in (4, 8)
            for ns in ((2, 3) if not SMOKE else (2,))
        ]
        for bn, nw, ns in variants:
            cfg = {"BLOCK_N": bn, "num_warps": nw, "num_stages": ns}
            key = f"{bn}/{nw}/{ns}"
            try:
                t = bench(lambda cfg=cfg: run_kvquant(p, f, p.q, config=cfg))
            except Exception as exc:  # e.g. out of shared memory
                row["tiles"][key] = {"error": type(exc).__name__}
                continue
            row["tiles"][key] = {"ms": t, "TBps": nbytes / t / 1e9}
        if (bsz, ctx) == (32, 16384):
            fg = p.fmt("group64")
            nb = nbytes + p.scale_bytes("group64")
            row["group64_tiles"] = {}
            for bn, nw, ns in variants:
                if ns == 3 or nw == 8:
                    continue
                cfg = {"BLOCK_N": bn, "num_warps": nw, "num_stages": ns}
                key = f"{bn}/{nw}/{ns}"
                try:
                    t = bench(lambda cfg=cfg: run_kvquant(p, fg, p.q, config=cfg))
                except Exception as exc:
                    row["group64_tiles"][key] = {"error": type(exc).__name__}
                    continue
                row["group64_tiles"][key] = {"ms": t, "TBps": nb / t / 1e9}
            del fg
        results["sweeps"].append(row)
        print(json.dumps(row), flush=True)
        del p, f


def run_prefill(results: dict[str, Any], deadline: float) -> None:
    """Chunk C causal over a paged prefix P (32/8/128) vs SDPA bf16 (K/V expanded).

    Tile configurations: ``benchmarks/tune_prefill.py``.
    """
    from torch.nn.attention.bias import causal_lower_right

    for bsz, prefix, chunk in PREFILL_SHAPES:
        if time.time() > deadline:
            results["skipped"].append(f"prefill B{bsz} {prefix}+{chunk}: time budget")
            continue
        hq, hkv, d = 32, 8, 128
        ctx = prefix + chunk
        p = Problem(bsz, ctx, hq, hkv, d, lq=chunk)
        flops = 4 * hq * d * (chunk * prefix + chunk * (chunk + 1) // 2) * bsz
        row: dict[str, Any] = {"B": bsz, "prefix": prefix, "chunk": chunk, "TFLOP": flops / 1e12}
        q = p.q.transpose(1, 2).contiguous()
        k = p.k.transpose(1, 2).repeat_interleave(hq // hkv, dim=1).contiguous()
        v = p.v.transpose(1, 2).repeat_interleave(hq // hkv, dim=1).contiguous()
        mask = causal_lower_right(chunk, ctx)
        t = bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=p.sm_scale))
        row["sdpa_bf16_ms"] = t
        row["sdpa_bf16_TFLOPs"] = flops / t / 1e9
        del k, v
        for name in PREFILL_FORMATS:
            f = p.fmt(name)
            err = check(p, f, p.q)
            t = bench(lambda f=f: run_kvquant(p, f, p.q))
            row[name] = {
                "ms": t,
                "TFLOPs": flops / t / 1e9,
                "rel_err": err,
                "ratio_vs_sdpa": row["sdpa_bf16_ms"] / t,
                "config": dataclasses.asdict(
                    choose_config(chunk, hq // hkv, d, group_dequant="group" in name)
                ),
            }
            del f
        results["prefill"].append(row)
        print(json.dumps(row), flush=True)
        del p


KT_DECODE_SHAPES = [
    (32, 8, 128, 32, 16384),
    (32, 8, 128, 16, 8192),
    (9, 3, 64, 32, 16384),
    (9, 3, 64, 16, 8192),
]
KT_PREFILL_SHAPES = [(4, 8192, 2048), (8, 2048, 512)]


# --kt-ablation: the k-transform with only some of its parts (the pages stay those of the full
# transform; each run is checked against the reference with the same parts), to show which
# part costs the time over per-head
KT_ABLATIONS: dict[str, tuple[str, ...]] = {
    "rot": ("k_rotation",),
    "off": ("k_offset",),
    "first": ("first_k", "first_v", "first_lens"),
    "rot+off": ("k_rotation", "k_offset"),
    "off+first": ("k_offset", "first_k", "first_v", "first_lens"),
}


def run_k_transform(results: dict[str, Any], deadline: float, ablation: bool = False) -> None:
    """``per-head-kt`` beside ``per-head`` on the same cache: decode (eager, graph), prefill.

    With ``ablation`` each of :data:`KT_ABLATIONS` too (checked against the reference first),
    recorded as ``per-head-kt{<parts>}`` with its ratios to per-head, one line printed each.
    """
    rows = results["k_transform"]
    shapes = [("decode", hq, hkv, d, bsz, ctx, 1) for hq, hkv, d, bsz, ctx in KT_DECODE_SHAPES]
    shapes += [("prefill", 32, 8, 128, b, pre + ch, ch) for b, pre, ch in KT_PREFILL_SHAPES]
    if SMOKE:
        shapes = [("decode", 32, 8, 128, 2, 256, 1), ("prefill", 32, 8, 128, 1, 192, 128)]
    runs: list[tuple[str, str, dict[str, Any] | None]] = [
        ("per-head", "per-head", None), ("per-head-kt", "per-head-kt", None)
    ]  # fmt: skip
    if ablation:
        runs += [(f"per-head-kt{{{a}}}", f"kt:{a}", None) for a in KT_ABLATIONS]
    for kind, hq, hkv, d, bsz, ctx, lq in shapes:
        label = f"{kind} {hq}/{hkv}/{d} B{bsz} ctx{ctx} lq{lq}"
        if time.time() > deadline:
            results["skipped"].append(f"k-transform {label}: time budget")
            continue
        p = Problem(bsz, ctx, hq, hkv, d, lq=lq)
        row: dict[str, Any] = {"kind": kind, "hq": hq, "hkv": hkv, "d": d, "B": bsz,
                               "ctx": ctx, "lq": lq}  # fmt: skip
        fmts = {name: p.fmt(name) for name in ("per-head", "per-head-kt")}
        for a, keep in KT_ABLATIONS.items() if ablation else ():
            fmts[f"kt:{a}"] = {
                k: v for k, v in fmts["per-head-kt"].items() if k not in KT_KEYS or k in keep
            }
        for key, name, cfg in runs:
            f = fmts[name]
            err = check(p, f, p.q, config=cfg)
            t = bench(lambda f=f, cfg=cfg: run_kvquant(p, f, p.q, config=cfg))
            row[key] = {"ms": t, "rel_err": err, "config": cfg}
            if kind == "decode" and not SMOKE:
                row[key]["graph_ms"] = bench_graph(
                    lambda f=f, cfg=cfg: run_kvquant(p, f, p.q, config=cfg)
                )
            if key != "per-head":
                row[key]["over_per_head"] = t / row["per-head"]["ms"]
                if "graph_ms" in row[key]:
                    g = row[key]["graph_ms"] / row["per-head"]["graph_ms"]
                    row[key]["over_per_head_graph"] = g
            if ablation and key != "per-head":
                line = f"kt variant {key:<24} {label}: {row[key]['over_per_head']:.3f}x eager"
                if "over_per_head_graph" in row[key]:
                    line += f", {row[key]['over_per_head_graph']:.3f}x graph"
                print(f"{line}, err {err:.1e}", flush=True)
        del fmts
        row["kt_over_per_head"] = row["per-head-kt"]["over_per_head"]
        if "over_per_head_graph" in row["per-head-kt"]:
            row["kt_over_per_head_graph"] = row["per-head-kt"]["over_per_head_graph"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del p


WRITE_SHAPES = [(32, 16384, 32, 8, 128), (16, 8192, 32, 8, 64), (64, 2048, 32, 8, 64)]
"""Decode steps whose write is timed: (B, ctx, Hq, Hkv, D); the last two are Llama-3.2-1B's
B16 x 8k and B64 x 2k of the end-to-end benchmark."""


def run_write(results: dict[str, Any], shapes: list[tuple[int, ...]] | None = None) -> None:
    """One decode step's write (per-tensor) vs that step's decode time, per shape of
    :data:`WRITE_SHAPES` (``results["write"]``: the first shape's, ``results["writes"]``: all)."""
    try:
        from kvquant.kernels import write_kv
    except ImportError as exc:
        results["write"] = {"skipped": f"kvquant.kernels.write_kv not importable: {exc}"}
        return
    results["writes"] = []
    for bsz, ctx, hq, hkv, d in shapes or WRITE_SHAPES:
        p = Problem(bsz, ctx, hq, hkv, d)
        f = p.fmt("per-tensor")
        key = torch.randn(bsz, 1, hkv, d, device=DEV, dtype=torch.bfloat16)
        val = torch.randn(bsz, 1, hkv, d, device=DEV, dtype=torch.bfloat16)
        # overwrite the last slot of each sequence (a valid slot of its last page)
        last_page = p.block_tables[:, -1].long()
        slots = (last_page * p.page + p.page - 1).view(bsz, 1)
        w = kernel_inputs(f, {})
        row: dict[str, Any] = {"shape": f"{hq}/{hkv}/{d} B{bsz}x{ctx}"}
        try:
            t_w = bench(lambda: write_kv(key, val, w["pages"], slots, w["scheme"]))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
            results["writes"].append(row)
            continue
        t_d = bench(lambda: run_kvquant(p, f, p.q))
        row.update({"write_ms": t_w, "decode_ms": t_d, "write_over_decode": t_w / t_d})
        try:
            g_w = bench_graph(lambda: write_kv(key, val, w["pages"], slots, w["scheme"]))
            g_d = bench_graph(lambda: run_kvquant(p, f, p.q))
            row.update(
                {
                    "graph_write_ms": g_w,
                    "graph_decode_ms": g_d,
                    "graph_write_over_decode": g_w / g_d,
                }
            )
        except Exception as exc:  # e.g. a host sync inside write_kv breaks capture
            row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
        results["writes"].append(row)
        print(json.dumps(row), flush=True)
        del p, f, w
    results["write"] = results["writes"][0]


def plot(results: dict[str, Any], out: Path) -> None:
    """Decode bandwidth bars (32/8/128) and prefill TFLOP/s, one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in results["decode"] if (r["hq"], r["hkv"], r["d"]) == (32, 8, 128)]
    fig, axes = plt.subplots(1, 2, figsize=(16, 5), gridspec_kw={"width_ratios": [3, 1]})
    ax = axes[0]
    names = ["sdpa_bf16", "per-tensor", "per-head", "group64", "group128"]
    width = 0.16
    xs = range(len(rows))
    for i, name in enumerate(names):
        vals = [
            (r["sdpa_bf16_TBps"] if name == "sdpa_bf16" else r.get(name, {}).get("TBps", 0))
            for r in rows
        ]
        ax.bar([x + i * width for x in xs], vals, width, label=name)
    read = results["bandwidth"]["read_sum_TBps"]
    ax.axhline(read, color="k", ls="--", lw=1, label=f"read probe {read:.2f} TB/s")
    ax.set_xticks([x + 2 * width for x in xs], [f"B{r['B']}\n{r['ctx'] // 1024}k" for r in rows])
    ax.set_ylabel("effective TB/s (bytes read / time)")
    ax.set_title("decode, Hq/Hkv/D = 32/8/128, H200")
    ax.legend(fontsize=8)
    ax = axes[1]
    pr = results["prefill"]
    labels = [f"B{r['B']}\n{r['prefix'] // 1024}k+{r['chunk']}" for r in pr]
    for i, name in enumerate(["sdpa_bf16", "per-tensor", "group64", "group128"]):
        vals = [
            (r["sdpa_bf16_TFLOPs"] if name == "sdpa_bf16" else r.get(name, {}).get("TFLOPs", 0))
            for r in pr
        ]
        ax.bar([x + i * 0.2 for x in range(len(pr))], vals, 0.2, label=name)
    ax.set_xticks([x + 0.3 for x in range(len(pr))], labels)
    ax.set_ylabel("TFLOP/s (visible keys)")
    ax.set_title("prefill/extend")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "attention.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop starting new shapes after")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter script check")
    ap.add_argument("--only-kt", action="store_true", help="only the k-transform section")
    ap.add_argument("--only-write", action="store_true", help="only the write section")
    ap.add_argument(
        "--kt-ablation",
        action="store_true",
        help="the k-transform section also times it with only some of its parts (KT_ABLATIONS)",
    )
    args = ap.parse_args()
    global DEV, SMOKE, SWEEP_SHAPES, PREFILL_SHAPES
    if args.smoke:
        DEV, SMOKE = "cpu", True
        SWEEP_SHAPES = [(1, 256)]
        PREFILL_SHAPES = [(1, 64, 128)]
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    deadline = start + args.budget_s
    if DEV == "cuda":
        props = torch.cuda.get_device_properties(0)
        gpu, sms = props.name, props.multi_processor_count
    else:
        gpu, sms = "cpu (smoke)", 0
    results: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "gpu": gpu,
        "sms": sms,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "page_size": PAGE,
        "timing": 'triton.testing.do_bench(warmup=25, rep=100, return_mode="median")',
        "bandwidth": probe_bandwidth(),
        "decode": [],
        "sweeps": [],
        "prefill": [],
        "k_transform": [],
        "skipped": [],
    }
    print(json.dumps(results["bandwidth"]), flush=True)
    if args.only_write:
        run_write(results)
        results["elapsed_s"] = time.time() - start
        save(results, args.out)
        return
    if args.only_kt:
        run_k_transform(results, deadline, args.kt_ablation)
        results["elapsed_s"] = time.time() - start
        save(results, args.out)
        summarize_kt(results)
        return
    formats = DECODE_FORMATS
    main_shapes = [(32, 8, 128, b, c) for b in (1, 8, 32, 64) for c in (1024, 4096, 16384, 32768)]
    extra = [(64, 8, 128, b, c) for b in (1, 8, 32) for c in (4096, 16384)]
    extra += [(9, 3, 64, b, c) for b in (1, 8, 32) for c in (4096, 16384)]
    if args.quick:
        main_shapes = [(32, 8, 128, 1, 32768), (32, 8, 128, 8, 1024), (32, 8, 128, 32, 16384)]
        extra = [(9, 3, 64, 8, 4096)]
    if args.smoke:
        main_shapes = [(32, 8, 128, 2, 256)]
        extra = [(9, 3, 64, 2, 128)]
    run_decode(main_shapes, formats, results, deadline)
    run_decode(extra, EXTRA_FORMATS, results, deadline)
    save(results, args.out)
    if not SMOKE:
        run_write(results)
    run_prefill(results, deadline + 60)
    save(results, args.out)
    run_k_transform(results, deadline + 90, args.kt_ablation)
    save(results, args.out)
    if not args.no_sweep:
        run_sweeps(results, deadline + 120)
    results["best_read_TBps"] = max(
        [results["bandwidth"]["read_sum_TBps"]]
        + [r["sdpa_bf16_TBps"] for r in results["decode"]]
        + [r[n]["TBps"] for r in results["decode"] for n in (*formats, *EXTRA_FORMATS) if n in r]
    )
    results["elapsed_s"] = time.time() - start
    save(results, args.out)
    plot(results, args.out)
    summarize(results)


def summarize(results: dict[str, Any]) -> None:
    """Print the decode/prefill tables and the target checks."""
    best = results["best_read_TBps"]
    print(
        f"\nread probe {results['bandwidth']['read_sum_TBps']:.2f} TB/s, best read {best:.2f} TB/s"
    )
    names = list(dict.fromkeys((*DECODE_FORMATS, *EXTRA_FORMATS)))
    print(f"{'shape':<22}{'sdpa ms':>9}" + "".join(f"{n:>22}" for n in names))
    for r in results["decode"]:
        line = f"{r['hq']}/{r['hkv']}/{r['d']} B{r['B']} {r['ctx'] // 1024}k".ljust(22)
        line += f"{r['sdpa_bf16_ms']:9.4f}"
        for n in names:
            if n in r:
                x = r[n]
                line += f"  {x['ms']:.4f} {x['TBps']:.2f} {x['speedup_vs_sdpa']:.2f}x".rjust(22)
            else:
                line += " " * 22
        print(line)
    for r in results["prefill"]:
        line = f"prefill B{r['B']} {r['prefix']}+{r['chunk']}: sdpa {r['sdpa_bf16_ms']:.3f} ms {r['sdpa_bf16_TFLOPs']:.0f} TF/s"
        for n in PREFILL_FORMATS:
            if n in r:
                line += f" | {n} {r[n]['ms']:.3f} ms {r[n]['TFLOPs']:.0f} TF/s {r[n]['ratio_vs_sdpa']:.2f}x err {r[n]['rel_err']:.1e}"
        print(line)
    errs = [
        r[n]["rel_err"] for r in results["decode"] + results["prefill"] for n in names if n in r
    ]
    worst = max(errs) if errs else math.nan
    print(f"worst rel err {worst:.2e} (tolerance {REL_TOL}); skipped: {results['skipped']}")
    summarize_kt(results)


def summarize_kt(results: dict[str, Any]) -> None:
    """Print the k-transform rows: time over per-head's (target: within 5 %)."""
    for r in results["k_transform"]:
        line = f"k-transform {r['kind']} {r['hq']}/{r['hkv']}/{r['d']} B{r['B']} ctx{r['ctx']}"
        line += f" lq{r['lq']}: per-head {r['per-head']['ms']:.4f} ms, kt "
        line += f"{r['per-head-kt']['ms']:.4f} ms = {r['kt_over_per_head']:.3f}x"
        if "kt_over_per_head_graph" in r:
            line += f" (graph {r['kt_over_per_head_graph']:.3f}x)"
        line += f", err {r['per-head']['rel_err']:.1e} / {r['per-head-kt']['rel_err']:.1e}"
        print(line)
        for key, x in r.items():
            if key.startswith("per-head-kt["):
                line = f"  {key:<26} {x['ms']:.4f} ms = {x['over_per_head']:.3f}x"
                if "over_per_head_graph" in x:
                    line += f" (graph {x['over_per_head_graph']:.3f}x)"
                print(f"{line}, err {x['rel_err']:.1e}")


if __name__ == "__main__":
    main()

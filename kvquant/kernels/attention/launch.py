"""Launcher of the paged-attention Triton kernels (decode and prefill/extend).

:func:`attention_launch` picks the :class:`~kvquant.kernels.attention.tuning.Tiles`, the
constexprs and the split-KV count (:mod:`kvquant.kernels.attention.tuning`; the split kernel's
residency measured once per compiled variant): an :class:`AttentionLaunch`, which a plan
(:mod:`kvquant.kernels.plan`) keeps. :func:`paged_attention_triton` launches
:mod:`kvquant.kernels.attention.kernel`'s kernels with it, with programmatic dependent launch
on sm_90 and newer (:func:`supports_pdl`). No argument validation here: plans validate.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import triton

from kvquant.errors import KernelInputError
from kvquant.kernels.attention.kernel import paged_attn_kernel, reduce_kernel
from kvquant.kernels.attention.tuning import (
    FOLD_MAX_ROWS,
    Tiles,
    choose_config,
    choose_num_splits,
    device_sm_count,
    is_decode,
    programs_per_sm,
)
from kvquant.schemes import CAUSAL, FirstTokens, Mask, Pages, RecentTokens, Scheme

__all__ = [
    "CONFIG_KEYS",
    "AttentionLaunch",
    "attention_launch",
    "is_interpreted",
    "paged_attention_triton",
    "pdl_capable",
    "supports_pdl",
]

# Triton reads TRITON_INTERPRET when the kernels are decorated: fixed for this process.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

CONFIG_KEYS: tuple[str, ...] = (
    *(f.name for f in Tiles.__dataclass_fields__.values()),
    "USE_WHILE",
    "FOLD",
    "PDL",
)
"""Keys of :func:`paged_attention_triton`'s ``config=`` override: the :class:`Tiles` fields,
``USE_WHILE`` (while-loops, default on in the interpreter), ``FOLD`` (fold group scales in
decode) and ``PDL`` (0: no programmatic dependent launch)."""


def is_interpreted() -> bool:
    """Whether the attention kernels run in the Triton interpreter (``TRITON_INTERPRET=1``)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(paged_attn_kernel, InterpretedFunction)


def pdl_capable(capability: tuple[int, int], *, hip: bool = False) -> bool:
    """Whether a GPU of compute ``capability`` takes programmatic dependent launches.

    NVIDIA devices of compute capability 9.0 and newer; never ROCm (which reports (9, x)
    capabilities too).
    """
    return not hip and capability[0] >= 9


_PDL: dict[int, bool] = {}


def supports_pdl(device: torch.device) -> bool:
    """Whether launches on ``device`` use programmatic dependent launch (a device fact).

    False on CPU and in the Triton interpreter; on CUDA :func:`pdl_capable` of the device's
    capability, read once per device index and kept for the process.
    """
    if _INTERPRETED or device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PDL:
        _PDL[idx] = pdl_capable(
            torch.cuda.get_device_capability(idx), hip=torch.version.hip is not None
        )
    return _PDL[idx]


_E4M3: dict[int, bool] = {}


def _converts_e4m3(device: torch.device) -> bool:
    """The GPU converts e4m3 pairs to fp16 in one instruction: NVIDIA devices of compute
    capability 8.9 and newer (cached); the 4-bit tiles are then decoded by inline PTX."""
    if _INTERPRETED or device.type != "cuda" or torch.version.hip is not None:
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _E4M3:
        _E4M3[idx] = torch.cuda.get_device_capability(idx) >= (8, 9)
    return _E4M3[idx]


# Registers, warps and shared memory of each compiled split-kernel variant: a fact of the
# compiled binary (and device), kept for the process; plans read it when they are built.
_KERNEL_USE: dict[tuple[Any, ...], tuple[int, int, int]] = {}


def _device_limits(device: torch.device) -> dict[str, int]:
    """Registers, shared memory and threads per SM (keywords of :func:`programs_per_sm`)."""
    props = torch.cuda.get_device_properties(device)
    return {
        "regs_per_sm": int(getattr(props, "regs_per_multiprocessor", 65536)),
        "shared_per_sm": int(getattr(props, "shared_memory_per_multiprocessor", 233472)),
        "threads_per_sm": int(getattr(props, "max_threads_per_multi_processor", 2048)),
    }


def _split_kernel_use(
    args: list[Any], consts: dict[str, Any], device: torch.device
) -> tuple[int, int, int]:
    """Registers per thread, warps and shared memory of the split decode kernel (memoised).

    The first call of a signature compiles the kernel (``warmup``, no launch).
    """
    # the pointers' dtypes and which optional ones are absent (a variant each)
    dtypes = tuple(a.dtype if isinstance(a, torch.Tensor) else None for a in args if a is None
                   or isinstance(a, torch.Tensor))  # fmt: skip
    key: tuple[Any, ...] = (device, dtypes, *sorted(consts.items()))
    use = _KERNEL_USE.get(key)
    if use is None:
        kernel = paged_attn_kernel.warmup(*args, grid=(1,), **{**consts, "SPLIT": True})
        _ = kernel.run  # loads the binary, which sets n_regs (Triton loads kernels lazily)
        use = _KERNEL_USE[key] = (
            int(kernel.n_regs), int(kernel.metadata.num_warps), int(kernel.metadata.shared)
        )  # fmt: skip
    return use


def _decode_residency(args: list[Any], consts: dict[str, Any], device: torch.device) -> int:
    """Resident programs per SM of the split decode kernel for this launch.

    From its compiled register and shared-memory use; the interpreter (CPU) assumes 2.
    """
    if _INTERPRETED or device.type != "cuda":
        return 2
    return programs_per_sm(*_split_kernel_use(args, consts, device), **_device_limits(device))


def _tiles(
    query: torch.Tensor,
    group: int,
    ng: int,
    group_scales: bool,
    config: Mapping[str, Any],
    fp4: tuple[int, int] = (0, 0),
) -> tuple[Tiles, bool]:
    """The launch's tiles and whether decode folds the group scales (``config`` overrides)."""
    lq, d = query.shape[1], query.shape[3]
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise KernelInputError(
            f"paged_attention_triton: config has keys {unknown}, expected only {CONFIG_KEYS}; "
            "fix: leave the other keys out (the launcher's experiments were retired: "
            "docs/dev/kernels.md)"
        )
    # Decode folds group scales into the scores and probabilities (no per-element multiply,
    # no range limit) while the tile's row copies stay within FOLD_MAX_ROWS (timings:
    # docs/performance.md).
    if "FOLD" in config:
        fold_wanted = bool(config["FOLD"])
    else:
        fold_wanted = triton.next_power_of_2(lq * group) * ng <= FOLD_MAX_ROWS
    fold = group_scales and is_decode(lq, group) and fold_wanted
    tiles = choose_config(
        lq,
        group,
        d,
        group_dequant=group_scales and not fold,
        fold_groups=ng if fold else 0,
        fp4=fp4,
    )
    tiles = tiles.replace(config)
    if any(fp4) and tiles.BLOCK_N < 32:
        raise KernelInputError(
            f"paged_attention_triton: config BLOCK_N={tiles.BLOCK_N} with 4-bit pages; "
            "expected 32 or more (on an H200, tiles of 16 keys read from 4-bit pages gave "
            "wrong attention: docs/dev/fp4-formats.md). Fix: BLOCK_N=32 or more, or leave "
            "BLOCK_N to the launcher."
        )
    return tiles, fold


def _kernel_args(
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    n_qblocks: int,
    opt: dict[str, Any],
) -> list[Any]:
    """``paged_attn_kernel``'s arguments up to the constexprs; absent tensors are ``None``.

    The partials, their log-sum-exp (``args[12:14]``, ``out`` until a split workspace exists)
    and the split count (``args[20]``) are set by the caller.
    """
    kg, vg = opt["k_group_scales"], opt["v_group_scales"]
    ks, vs = (opt["k_scale"], opt["v_scale"]) if kg is None else (None, None)
    kb, vb = opt["k_block_scales"], opt["v_block_scales"]
    first_k = opt["first_k"]
    return [
        query, k_pages, v_pages, block_tables, seq_lens, opt["q_lens"], opt["kv_start"],
        ks, vs, kg, vg, out, out, out,
        float(opt["sm_scale"]), float(opt["softcap"]) if opt["softcap"] > 0 else 1.0,
        int(opt["window"]), query.shape[1], query.shape[2], n_qblocks, 2,
        query.stride(), k_pages.stride(), v_pages.stride(), block_tables.stride(0),
        (ks.stride(0) if ks is not None and ks.dim() else 0,
         vs.stride(0) if vs is not None and vs.dim() else 0),
        kg.stride()[:3] if kg is not None else (0, 0, 0),
        vg.stride()[:3] if vg is not None else (0, 0, 0),
        out.stride(), opt["sinks"], opt["k_rotation"], opt["k_offset"],
        first_k, opt["first_v"] if first_k is not None else None,
        opt["first_lens"] if first_k is not None else None,
        (first_k.shape[1] if first_k is not None else 0,
         opt["recent_kv"].shape[2] if opt["recent_kv"] is not None else 0),
        kb, vb, kb.stride()[:3] if kb is not None else (0, 0, 0),
        vb.stride()[:3] if vb is not None else (0, 0, 0),
        opt["recent_kv"],
    ]  # fmt: skip


def _constexprs(
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    tiles: Tiles,
    fold: bool,
    opt: dict[str, Any],
    config: Mapping[str, Any],
) -> dict[str, Any]:
    """``paged_attn_kernel``'s constexprs (but ``SPLIT``) and launch options."""
    page_size, hkv, d = k_pages.shape[1], k_pages.shape[2], query.shape[3]
    kg, vg = opt["k_group_scales"], opt["v_group_scales"]
    ng = kg.shape[-1] if kg is not None else 1
    # keys per run of a tile that stays inside one page (the kernel's TP; tiles start at
    # multiples of it)
    tp = math.gcd(page_size, tiles.BLOCK_N)
    pdl = supports_pdl(query.device) and bool(config.get("PDL", True))
    ptx = _converts_e4m3(query.device)
    return {
        "GROUP": query.shape[2] // hkv,
        "QPB": tiles.QPB,
        "BLOCK_M": tiles.BLOCK_M,
        "BLOCK_N": tiles.BLOCK_N,
        "HEAD_D": d,
        "PAGE": page_size,
        # V stored keys-fastest with runs of whole pages: a run's [D, TP] block is contiguous
        "V_RUNS_DENSE": v_pages.stride(1) == 1 and v_pages.stride(3) == tp,
        # group scales stored head-major: a run's [TP, NG] scales are contiguous. Loaded so
        # where they fold (decode) or with one group per head (per-key loads were faster for
        # several groups per head in prefill: docs/dev/kernels.md, tuning)
        "SCALE_RUNS_DENSE": kg is not None
        and kg.stride(1) == ng
        and vg.stride(1) == ng
        and (fold or ng == 1),
        # one group per head: the scales fold into the scores and the probabilities
        "FOLD": fold,
        "NG": ng,
        "CAUSAL": bool(opt["causal"]),
        "USE_SOFTCAP": opt["softcap"] > 0,
        "USE_WINDOW": opt["window"] > 0,
        "USE_WHILE": bool(config.get("USE_WHILE", _INTERPRETED)),
        "LOOP_STAGES": tiles.LOOP_STAGES,
        "PDL": pdl,
        # a 4-bit side's format (1 NVFP4, 2 MXFP4), plus 4 where inline PTX decodes it
        "K_FP4": opt["k_fp4"] + (4 if opt["k_fp4"] and ptx else 0),
        "V_FP4": opt["v_fp4"] + (4 if opt["v_fp4"] and ptx else 0),
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
        "launch_pdl": pdl,
    }


def _merge(
    part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, num_splits: int,
    sinks: torch.Tensor | None, pdl: bool,
) -> None:  # fmt: skip
    """Launch the split merge: one-warp programs of 32 columns of an output row."""
    bsz, lq, hq, d = out.shape
    # one warp per 32 columns: the merge is latency-bound, and at B1 x 32k it had only 32
    # programs (one per row); the graph table of bench_attention.py times it
    block_d = min(32, d)
    reduce_kernel[(bsz * lq * hq, d // block_d)](
        part, lse, out, lq, hq, num_splits, *out.stride(), sinks,
        SPLITS_P2=max(2, triton.next_power_of_2(num_splits)), HEAD_D=d, BLOCK_D=block_d,
        PDL=pdl, num_warps=1, launch_pdl=pdl,
    )  # fmt: skip


@dataclass(frozen=True, eq=False)
class AttentionLaunch:
    """The Triton launch chosen for one call geometry (kept by an attention plan).

    Attributes:
        tiles: the kernel's tiles.
        fold: whether decode folds the group scales into the scores.
        consts: ``paged_attn_kernel``'s constexprs (but ``SPLIT``) and launch options.
        n_qblocks: query blocks per (KV head, sequence).
        num_splits: split-KV count (1: no split).
        k_fp4: 0 FP8 K, 1 NVFP4 (global scale), 2 MXFP4 (no scale).
        v_fp4: as ``k_fp4`` for V.
        one: fp32 ``1.0`` on the device (MXFP4's static multiplier), or None.
        rotate_query: a K rotation is applied to the query before the launch (decode:
            :func:`_rotated_query`), not by each program.
    """

    tiles: Tiles
    fold: bool
    consts: Mapping[str, Any]
    n_qblocks: int
    num_splits: int
    k_fp4: int
    v_fp4: int
    one: torch.Tensor | None
    rotate_query: bool = False


def rotates_query_first(n_qblocks: int, pairs: int, device: torch.device) -> bool:
    """Whether a launch with a K rotation gets its query rotated before the kernel
    (:func:`_rotated_query`) rather than by each of the kernel's programs.

    A decode launch (one query block) over at least two (sequence, KV head) pairs per
    multiprocessor: there the programs' own rotations made the decode kernel 1.7 times
    slower (64 sequences of 2048 tokens, Llama-3.2-1B, H200), while with fewer pairs the
    extra product's launches cost more than the rotations they save.
    """
    return n_qblocks == 1 and pairs >= 2 * device_sm_count(device)


def _rotated_query(query: torch.Tensor, opt: dict[str, Any]) -> torch.Tensor:
    """``query @ R`` in fp32 for a decode launch, and ``opt`` without the rotation.

    The kernel then reads the rotated query as given: the offset's term ``q'·c`` from the
    fp32 values, the tiles from their fp16 cast, as the kernel's own rotation does.
    """
    rotation = opt["k_rotation"]
    opt["k_rotation"] = None
    return torch.matmul(query.float(), rotation)


def _fp4_codes(scheme: Scheme) -> tuple[int, int]:
    """Each side's 4-bit code: 0 FP8, 1 NVFP4 (global scale), 2 MXFP4 (none)."""
    view = scheme.kernel_view()
    k_fp4, v_fp4 = (
        0 if f is None else 1 if f.global_scale else 2 for f in (view.k_fp4, view.v_fp4)
    )
    return k_fp4, v_fp4


def _options(
    query: torch.Tensor, pages: Pages, scheme: Scheme, mask: Mask, first: FirstTokens | None,
    sm_scale: float, k_fp4: int, v_fp4: int, one: torch.Tensor | None,
    recent: RecentTokens | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The call's tensors and options as the kernel takes them (absent ones None)."""
    view = scheme.kernel_view()
    group_scales = view.group_size is not None
    # a 4-bit side: its block scales as uint8 codes, NVFP4's global scale folded as a static
    # scale, MXFP4's (none) as one
    k_scale, v_scale = (
        one if f == 2 else s for f, s in ((k_fp4, view.k_scale), (v_fp4, view.v_scale))
    )
    return dict(
        sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, k_fp4=k_fp4, v_fp4=v_fp4,
        k_block_scales=pages.k_scales.view(torch.uint8) if k_fp4 else None,  # type: ignore[union-attr]
        v_block_scales=pages.v_scales.view(torch.uint8) if v_fp4 else None,  # type: ignore[union-attr]
        k_group_scales=pages.k_scales if group_scales else None,
        v_group_scales=pages.v_scales if group_scales else None, q_lens=mask.q_lens,
        kv_start=mask.kv_start, causal=mask.causal, softcap=mask.softcap, window=mask.window,
        sinks=mask.sinks, k_offset=view.k_offset, k_rotation=view.k_rotation,
        first_k=None if first is None else first.k, first_v=None if first is None else first.v,
        first_lens=None if first is None else first.lens,
        recent_kv=None if recent is None else recent.kv,
    )  # fmt: skip


def attention_launch(
    query: torch.Tensor,
    pages: Pages,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scheme: Scheme,
    *,
    sm_scale: float,
    mask: Mask = CAUSAL,
    first: FirstTokens | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: Mapping[str, Any] | None = None,
    recent: RecentTokens | None = None,
) -> AttentionLaunch:
    """The launch of :func:`paged_attention_triton` for these (validated, non-empty) arguments.

    It depends only on what a plan's signature holds (shapes, strides, dtypes, options), so
    every call of the plan reuses it. ``num_splits`` and ``config``: overrides (tests, tuning).
    """
    bsz, lq, hq, _ = query.shape
    k_pages, v_pages = pages.k, pages.v
    hkv = k_pages.shape[2]
    config = config or {}
    group_scales = scheme.kernel_view().group_size is not None
    k_fp4, v_fp4 = _fp4_codes(scheme)
    one = None
    if 2 in (k_fp4, v_fp4):
        one = torch.ones((), dtype=torch.float32, device=query.device)
    opt = _options(query, pages, scheme, mask, first, sm_scale, k_fp4, v_fp4, one, recent)
    ng = pages.k_scales.shape[-1] if group_scales and pages.k_scales is not None else 1
    tiles, fold = _tiles(query, hq // hkv, ng, group_scales, config, (k_fp4, v_fp4))
    n_qblocks = triton.cdiv(lq, tiles.QPB)
    rotate_query = opt["k_rotation"] is not None and rotates_query_first(
        n_qblocks, bsz * hkv, query.device
    )
    if rotate_query:  # the kernel's variant: an fp32 query, no rotation (_rotated_query)
        opt["k_rotation"] = None
        out = out if out is not None else query
        query = torch.empty_like(query, dtype=torch.float32)
    consts = _constexprs(query, k_pages, v_pages, tiles, fold, opt, config)
    if num_splits is None:
        num_splits = 1
        if n_qblocks == 1:  # decode: split the keys to fill the GPU
            target = out if out is not None else query
            args = _kernel_args(query, k_pages, v_pages, block_tables, seq_lens, target,
                                n_qblocks, opt)  # fmt: skip
            num_splits = choose_num_splits(
                bsz * hkv,
                block_tables.shape[1] * k_pages.shape[1],
                device_sm_count(query.device),
                programs_per_sm=_decode_residency(args, consts, query.device),
                block_n=tiles.BLOCK_N,
            )
    return AttentionLaunch(
        tiles, fold, consts, n_qblocks, num_splits, k_fp4, v_fp4, one, rotate_query
    )


def paged_attention_triton(
    query: torch.Tensor,
    pages: Pages,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scheme: Scheme,
    *,
    sm_scale: float,
    mask: Mask = CAUSAL,
    first: FirstTokens | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: Mapping[str, Any] | None = None,
    launch: AttentionLaunch | None = None,
    recent: RecentTokens | None = None,
) -> torch.Tensor:
    """Attention of new query tokens over the paged FP8 cache (Triton); no validation.

    Semantics are those of :func:`kvquant.kernels.paged_attention_reference`; the arguments
    are :func:`kvquant.kernels.paged_attention`'s (already validated; ``block_tables``' last
    dimension and the transform's tensors contiguous), plus overrides for tests and tuning.
    The scheme, mask and first tokens are unpacked here into the kernel's pointers (None when
    absent: the kernel derives its presence flags from them) and constexprs.

    Args:
        query: ``[B, Lq, Hq, D]`` fp16, bf16 or fp32, any strides.
        pages: FP8 ``[num_pages, page_size, Hkv, D]`` K and V, any strides (fastest with V
            keys-contiguous within a page: :func:`kvquant.kernels.page_storage`); a 4-bit
            side packed ``[num_pages, page_size, Hkv, D // 2]`` with its block scales.
        num_splits: split-KV count override for the decode path (tests, tuning).
        config: overrides of the launch, keys :data:`CONFIG_KEYS`; others are refused.
        launch: the launch a plan chose for these arguments' geometry
            (:func:`attention_launch`); None: chosen here (with the overrides).

    Returns:
        ``[B, Lq, Hq, D]`` in the query dtype (``out`` when given).
    """
    bsz, lq, hq, d = query.shape
    k_pages, v_pages = pages.k, pages.v
    hkv = k_pages.shape[2]
    if out is None:
        out = torch.empty(bsz, lq, hq, d, dtype=query.dtype, device=query.device)
    if bsz == 0 or lq == 0:
        return out
    if launch is None:
        launch = attention_launch(
            query, pages, block_tables, seq_lens, scheme, sm_scale=sm_scale, mask=mask,
            first=first, out=out, num_splits=num_splits, config=config, recent=recent,
        )  # fmt: skip
    opt = _options(
        query, pages, scheme, mask, first, sm_scale, launch.k_fp4, launch.v_fp4, launch.one,
        recent,
    )  # fmt: skip
    if launch.rotate_query:
        query = _rotated_query(query, opt)
    n_qblocks, num_splits, consts = launch.n_qblocks, launch.num_splits, launch.consts
    args = _kernel_args(query, k_pages, v_pages, block_tables, seq_lens, out, n_qblocks, opt)
    split = num_splits > 1
    if split:
        # one workspace: partial outputs [B, Lq, Hq, S, D], their log2-sum-exp [B, Lq, Hq, S]
        rows = bsz * lq * hq * num_splits
        work = torch.empty(rows * (d + 1), dtype=torch.float32, device=query.device)
        args[12], args[13] = work[: rows * d], work[rows * d :]
    args[20] = num_splits
    dev = query.device
    # Triton launches on the current CUDA device: switch only when the tensors are elsewhere
    # (a layer of a model split over several GPUs).
    switch = (
        dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device()
    )
    with torch.cuda.device(dev) if switch else contextlib.nullcontext():
        paged_attn_kernel[(n_qblocks * num_splits, hkv, bsz)](*args, SPLIT=split, **consts)
        if split:
            _merge(args[12], args[13], out, num_splits, mask.sinks, bool(consts["PDL"]))
    return out

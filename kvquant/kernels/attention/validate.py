"""Argument checks of :func:`kvquant.kernels.paged_attention` (structure, then values).

Built on :mod:`kvquant.kernels.validate` (its helpers, scheme checks and signatures): the
query, pages, block tables, lengths, the :class:`~kvquant.schemes.Mask`, sinks and the K
transform's side buffer (:class:`~kvquant.schemes.FirstTokens`). The structural checks run
when a plan is built (:func:`kvquant.kernels.plan.plan_attention`), the value checks on
every run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch

from kvquant.kernels.validate import (
    INPUT_DTYPES,
    check_device,
    check_dtype,
    check_fp4_pages,
    check_index_vector,
    check_ndim,
    check_pages,
    check_recent_tokens,
    check_scheme_tensors,
    check_shape,
    check_sink_values,
    fail,
    overlaps,
    require_tensor,
    signature,
    unpack,
    value_checks_enabled,
)
from kvquant.schemes import FirstTokens, Fp4Format, KernelView, Mask, Pages, RecentTokens, Scheme

__all__ = [
    "AttentionGeometry",
    "attention_signature",
    "check_attention_inputs",
    "check_attention_structure",
    "check_attention_values",
]


@dataclass(frozen=True)
class AttentionGeometry:
    """Sizes read from validated :func:`~kvquant.kernels.paged_attention` arguments.

    Attributes:
        batch: ``B``.
        q_len: ``Lq``.
        num_heads: ``Hq``.
        num_kv_heads: ``Hkv``.
        head_dim: ``D``.
        num_pages: pages in the cache.
        page_size: token slots per page.
        max_pages: block-table width.
        group_size: ``G`` for dynamic group scales, ``None`` for static scales.
    """

    batch: int
    q_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    max_pages: int
    group_size: int | None


def _fp4_code(fmt: Fp4Format | None) -> int:
    """0 for FP8 pages, else the 4-bit format's block size (a signature's part)."""
    return 0 if fmt is None else fmt.block_size


def _check_first_tokens(
    op: str, first: object, scheme: Scheme, bsz: int, hkv: int, d: int, device: torch.device
) -> None:
    """Structure of the first-token side buffer: a FirstTokens, with static FP8 K scales or a
    scheme that stores K in the k-transform's frame (``transforms_keys``, FP8 or 4-bit K)."""
    if first is None:
        return
    if not isinstance(first, FirstTokens):
        raise fail(
            f"{op}: first is a {type(first).__name__}; expected kvquant.schemes.FirstTokens or "
            "None. Fix: pass FirstTokens(first_k, first_v, first_lens)."
        )
    parts = {"first_k": first.k, "first_v": first.v, "first_lens": first.lens}
    missing = [name for name, x in parts.items() if x is None]
    if missing:
        raise fail(
            f"{op}: {', '.join(missing)} is None but the other first-token arguments are "
            "given; expected FirstTokens(first_k, first_v, first_lens) with all three tensors. "
            "Fix: pass all three (first_lens zeros where a row has none), or first=None."
        )
    view = scheme.kernel_view()
    if view.k_fp4 is not None and not scheme.transforms_keys:
        raise fail(
            f"{op}: first-token buffers (first_k / first_v) were given with the 4-bit scheme "
            f"{scheme.name!r}; expected a scheme whose K is in the k-transform's frame "
            "(KTransformNvfp4Scales, KTransformMxfp4Scales) or FP8 K with static scales. Fix: "
            "drop first, or pass the layer's K transform in the scheme."
        )
    if view.group_size is not None:
        raise fail(
            f"{op}: first-token buffers (first_k / first_v) were given with fp32 group "
            "scales; expected static k_scale and v_scale (the k-transform format). Fix: pass "
            "a KTransformScales scheme, or drop first."
        )
    fk = require_tensor(op, "first_k", first.k)
    fv = require_tensor(op, "first_v", first.v)
    layout = "[batch, n_first, num_kv_heads, head_dim]"
    check_ndim(op, "first_k", fk, 4, layout)
    fix = "keep the first tokens' K (rotated frame) and V in the model dtype."
    check_dtype(op, "first_k", fk, INPUT_DTYPES, fix)
    check_dtype(op, "first_v", fv, INPUT_DTYPES, fix)
    nf = fk.shape[1]
    check_shape(op, "first_k", fk, (bsz, nf, hkv, d), f"{layout} of the query and pages")
    check_shape(op, "first_v", fv, (bsz, nf, hkv, d), f"{layout}, the shape of first_k")
    check_device(op, "first_k", fk, device, "k_pages")
    check_device(op, "first_v", fv, device, "k_pages")
    check_index_vector(op, "first_lens", first.lens, bsz, device)


def _check_mask(op: str, mask: object, bsz: int, hq: int, device: torch.device) -> None:
    """The mask's options and tensors."""
    if not isinstance(mask, Mask):
        raise fail(
            f"{op}: mask is a {type(mask).__name__}; expected kvquant.schemes.Mask. "
            "Fix: pass Mask(causal=..., window=..., softcap=..., kv_start=..., q_lens=...)."
        )
    if mask.q_lens is not None:
        check_index_vector(op, "q_lens", mask.q_lens, bsz, device)
    if mask.kv_start is not None:
        check_index_vector(op, "kv_start", mask.kv_start, bsz, device)
    causal, softcap, window = mask.causal, mask.softcap, mask.window
    if not isinstance(causal, bool):
        raise fail(f"{op}: causal is a {type(causal).__name__}; expected a bool.")
    if (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not math.isfinite(softcap)
        or softcap < 0
    ):
        raise fail(
            f"{op}: softcap is {softcap!r}; expected a finite float > 0, or 0 to disable it. "
            "Fix: pass the model's attn_logit_softcapping or 0.0."
        )
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise fail(
            f"{op}: window is {window!r}; expected an int >= 0 (0 disables it). "
            "Fix: pass the model's sliding_window or 0."
        )
    if mask.sinks is not None:
        sk = require_tensor(op, "sinks", mask.sinks)
        check_dtype(op, "sinks", sk, (torch.float32,), "pass module.sinks.float() (fp32).")
        check_shape(op, "sinks", sk, (hq,), "one attention-sink logit per query head")
        check_device(op, "sinks", sk, device, "k_pages")
        if hq > 1 and sk.stride(0) != 1:
            raise fail(
                f"{op}: sinks has stride {sk.stride(0)}; expected a contiguous [{hq}] tensor. "
                "Fix: pass sinks.contiguous() once, when it is created."
            )


def _check_out(op: str, out: object, q: torch.Tensor, device: torch.device) -> None:
    o = require_tensor(op, "out", out)
    check_shape(op, "out", o, tuple(q.shape), "the query's shape")
    if o.dtype != q.dtype:
        raise fail(
            f"{op}: out has dtype {o.dtype}; expected the query dtype {q.dtype}. "
            "Fix: allocate out like the query (torch.empty_like(query))."
        )
    check_device(op, "out", o, device, "k_pages")
    if overlaps(o):
        raise fail(
            f"{op}: out is written in place but has strides {o.stride()} for shape "
            f"{tuple(o.shape)}, so that elements share memory (an expanded view?); "
            "expected no two elements sharing memory. Fix: allocate out with "
            "torch.empty_like(query) or torch.empty(query.shape)."
        )


def _check_attention_structure(
    query: object,
    pages: Pages,
    block_tables: object,
    seq_lens: object,
    scheme: Scheme,
    view: KernelView,
    sm_scale: object,
    mask: object,
    first: object,
    out: object,
    recent: object = None,
) -> AttentionGeometry:
    """Dtype, shape, device, stride and option checks of :func:`check_attention_inputs`."""
    op = "paged_attention"
    fp4 = view.k_fp4 is not None or view.v_fp4 is not None
    if fp4:
        d_scheme = scheme.dims()[1]
        num_pages, page_size, hkv, d = check_fp4_pages(
            op, pages, view, d_scheme if d_scheme is not None else 0, written=False
        )
        kp = pages.k
    else:
        kp, _ = check_pages(op, pages.k, pages.v, written=False)
        num_pages, page_size, hkv, d = kp.shape
    device = kp.device
    q = require_tensor(op, "query", query)
    layout = "[batch, q_len, num_heads, head_dim] (HF's [B, H, L, D] .transpose(1, 2) is fine)"
    check_ndim(op, "query", q, 4, layout)
    check_dtype(op, "query", q, INPUT_DTYPES, "cast the query to float16, bfloat16 or float32.")
    bsz, lq, hq, qd = q.shape
    if qd != d:
        raise fail(
            f"{op}: query has head_dim {qd} but the pages have head_dim {d}. "
            "Fix: pass the cache built for this layer's geometry."
        )
    if hq == 0 or hq % hkv != 0:
        raise fail(
            f"{op}: query has {hq} heads, not a positive multiple of the pages' {hkv} KV heads. "
            "Fix: pass the cache built for this model's num_key_value_heads."
        )
    check_device(op, "query", q, device, "k_pages")
    bt = require_tensor(op, "block_tables", block_tables)
    check_ndim(op, "block_tables", bt, 2, "[batch, max_pages]")
    check_dtype(
        op,
        "block_tables",
        bt,
        (torch.int32,),
        "use kvquant.cache.PageAllocator.block_tables (int32), or .to(torch.int32) once per step.",
    )
    if bt.shape[0] != bsz:
        raise fail(
            f"{op}: block_tables has {bt.shape[0]} rows but query has batch {bsz}; expected "
            "one row per sequence. Fix: build block_tables for the same sequences as the query."
        )
    check_device(op, "block_tables", bt, device, "k_pages")
    check_index_vector(op, "seq_lens", seq_lens, bsz, device)
    geometry = (num_pages, page_size, hkv, d)
    group_size = None
    if not fp4:
        group_size = check_scheme_tensors(
            op, pages, view, geometry, device, group_scales_written=False
        )
    _check_first_tokens(op, first, scheme, bsz, hkv, d, device)
    check_recent_tokens(op, recent, bsz, hkv, d, device)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise fail(
            f"{op}: sm_scale is a {type(sm_scale).__name__}; expected a Python float. "
            "Fix: pass sm_scale=head_dim ** -0.5 (or the model's scaling)."
        )
    if not math.isfinite(float(sm_scale)):
        raise fail(
            f"{op}: sm_scale is {sm_scale}; expected a finite float. Fix: pass a finite scale."
        )
    _check_mask(op, mask, bsz, hq, device)
    if out is not None:
        _check_out(op, out, q, device)
    return AttentionGeometry(bsz, lq, hq, hkv, d, num_pages, page_size, bt.shape[1], group_size)


def _page_ids_in_range(bt: torch.Tensor, lens: list[int], page_size: int, num_pages: int) -> bool:
    """Whether every block-table entry a sequence uses lies in ``[0, num_pages)`` (one read)."""
    used = torch.tensor([(n + page_size - 1) // page_size for n in lens], device=bt.device)
    cols = torch.arange(bt.shape[1], device=bt.device)
    out = (bt < 0) | (bt >= num_pages)
    return not bool((out & (cols[None, :] < used[:, None])).any())


def _raise_page_id_error(
    op: str, bt: torch.Tensor, lens: list[int], page_size: int, num_pages: int
) -> None:
    """Name the first row of ``bt`` that uses a page id outside ``[0, num_pages)``."""
    for b, n in enumerate(lens):
        used = (n + page_size - 1) // page_size
        if used:
            row = bt[b, :used]
            lo, hi = int(row.min()), int(row.max())
            if lo < 0 or hi >= num_pages:
                raise fail(
                    f"{op}: block_tables row {b} uses page ids {lo}..{hi}; expected "
                    f"0..{num_pages - 1} (the cache has {num_pages} pages). "
                    "Fix: take block tables from the cache's PageAllocator."
                )


def _check_attention_values(
    bt: torch.Tensor,
    sl: torch.Tensor,
    ql: torch.Tensor | None,
    ks: torch.Tensor | None,
    geo: AttentionGeometry,
    first_lens: torch.Tensor | None = None,
    n_first: int = 0,
) -> None:
    """Value checks of :func:`check_attention_inputs` (read the index tensors: sync a GPU)."""
    op = "paged_attention"
    num_pages, page_size, lq = geo.num_pages, geo.page_size, geo.q_len
    max_pages = bt.shape[1]
    lens = sl.tolist()
    if min(lens) < 0 or max(lens) > max_pages * page_size:
        raise fail(
            f"{op}: seq_lens holds {min(lens)}..{max(lens)}; expected 0..{max_pages * page_size} "
            f"(block_tables has {max_pages} pages of {page_size} tokens per row). "
            "Fix: pass seq_lens and block_tables from the same PageAllocator step."
        )
    if not _page_ids_in_range(bt, lens, page_size, num_pages):
        _raise_page_id_error(op, bt, lens, page_size, num_pages)
    if ql is None:
        for b, n in enumerate(lens):
            if 0 < n < lq:
                raise fail(
                    f"{op}: seq_lens[{b}] is {n} but the query has {lq} tokens and q_lens is "
                    "None (every query token needs its own key in the cache). Fix: pass "
                    "q_lens for ragged batches, or write the new tokens before attending."
                )
    else:
        qls = ql.tolist()
        for b, (nq, n) in enumerate(zip(qls, lens, strict=True)):
            if nq < 0 or nq > lq or nq > n:
                raise fail(
                    f"{op}: q_lens[{b}] is {nq}; expected 0..min(q_len={lq}, seq_lens[{b}]={n}) "
                    "(the new queries' own keys are already in the cache). "
                    "Fix: write the new tokens before attending and pass their count."
                )
    if ks is not None:
        starts = ks.tolist()
        for b, (s0, n) in enumerate(zip(starts, lens, strict=True)):
            if s0 < 0 or s0 > n:
                raise fail(
                    f"{op}: kv_start[{b}] is {s0}; expected 0..seq_lens[{b}]={n}. "
                    "Fix: pass the number of left-padding tokens of each sequence."
                )
    if first_lens is not None:
        starts = ks.tolist() if ks is not None else [0] * len(lens)
        for b, (nf, s0, n) in enumerate(zip(first_lens.tolist(), starts, lens, strict=True)):
            if nf < 0 or nf > n_first or s0 + nf > n:
                raise fail(
                    f"{op}: first_lens[{b}] is {nf}; expected 0..min(n_first={n_first}, "
                    f"seq_lens[{b}] - kv_start[{b}] = {n - s0}) (first_k holds {n_first} "
                    "tokens per row, and only tokens in the cache can be first tokens). Fix: "
                    "count the first tokens stored for each row (0 where it has none)."
                )


def attention_signature(
    query: object,
    pages: object,
    block_tables: object,
    seq_lens: object,
    scheme: object,
    *,
    sm_scale: object,
    mask: object,
    first: object = None,
    out: object = None,
    recent: object = None,
) -> tuple[object, ...] | None:
    """Everything :func:`check_attention_structure` reads from the arguments, as a hashable key.

    Options count by type and value (:func:`~kvquant.kernels.validate.signature`); None
    when no plan can be reused for these arguments (an argument of another kind).

    Raises:
        KernelInputError: ``pages`` or ``scheme`` is not one.
    """
    bundle, view = unpack("paged_attention", pages, scheme)
    if not isinstance(mask, Mask):
        return None
    fk = fv = fl = None
    if isinstance(first, FirstTokens):
        fk, fv, fl = first.k, first.v, first.lens
        if fk is None:
            return None
    elif first is not None:
        return None
    rkv = None
    if isinstance(recent, RecentTokens):
        rkv = recent.kv
    elif recent is not None:
        return None
    head_dim = scheme.dims()[1]  # type: ignore[attr-defined]  # unpack checked it
    m = mask
    return signature(
        query, bundle.k, bundle.v, bundle.k_scales, bundle.v_scales, block_tables, seq_lens,
        sm_scale, view.k_scale, view.v_scale, view.k_offset, view.k_rotation,
        view.group_size, m.q_lens, m.kv_start, m.causal, m.softcap, m.window, m.sinks, out,
        fk, fv, fl, _fp4_code(view.k_fp4), _fp4_code(view.v_fp4), head_dim, rkv,
    )  # fmt: skip


def check_attention_structure(
    query: object,
    pages: object,
    block_tables: object,
    seq_lens: object,
    scheme: object,
    *,
    sm_scale: object,
    mask: object,
    first: object = None,
    out: object = None,
    recent: object = None,
) -> AttentionGeometry:
    """Dtype, shape, device, stride and option checks of :func:`check_attention_inputs`.

    They read only metadata: a plan runs them once for the arguments' signature.

    Raises:
        KernelInputError: any argument is malformed.
    """
    bundle, view = unpack("paged_attention", pages, scheme)
    return _check_attention_structure(
        query, bundle, block_tables, seq_lens, scheme,  # type: ignore[arg-type]  # unpack checked it
        view, sm_scale, mask, first, out, recent,
    )  # fmt: skip


def check_attention_values(
    pages: Pages,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    mask: Mask,
    first: FirstTokens | None,
    geo: AttentionGeometry,
) -> None:
    """Value checks of :func:`check_attention_inputs`, on arguments that passed the structure.

    The sinks are finite (read once per tensor version); lengths and page ids lie inside the
    cache where values are cheap to read (:func:`~kvquant.kernels.validate.value_checks_enabled`).

    Raises:
        KernelInputError: a value is out of range.
    """
    if mask.sinks is not None:
        check_sink_values("paged_attention", "sinks", mask.sinks)
    if geo.batch and value_checks_enabled(pages.k.device):
        fk = None if first is None else first.k
        _check_attention_values(
            block_tables,
            seq_lens,
            mask.q_lens,
            mask.kv_start,
            geo,
            None if first is None else first.lens,
            fk.shape[1] if fk is not None else 0,
        )


def check_attention_inputs(
    query: object,
    pages: object,
    block_tables: object,
    seq_lens: object,
    scheme: object,
    *,
    sm_scale: object,
    mask: object,
    first: object = None,
    out: object = None,
    recent: object = None,
) -> AttentionGeometry:
    """Validate the arguments of :func:`kvquant.kernels.paged_attention` (every check).

    :func:`check_attention_structure` (dtype, shape, device, stride and option checks), then
    :func:`check_attention_values` (lengths and page ids inside the cache, where values are
    cheap to read). The scheme's own values were checked when it was built. A plan
    (:func:`kvquant.kernels.plan.plan_attention`) runs the first part once, the second on
    every run.

    Args:
        query: ``[B, Lq, Hq, D]`` fp32/fp16/bf16, any strides, ``Hq % Hkv == 0``.
        pages: :class:`~kvquant.schemes.Pages`, FP8 ``[num_pages, page_size, Hkv, D]``.
        block_tables: int32 ``[B, max_pages]``.
        seq_lens: int32 ``[B]``.
        scheme: a :class:`~kvquant.schemes.Scheme` for the pages' ``Hkv`` and ``D``.
        sm_scale: softmax scale (a finite Python number).
        mask: a :class:`~kvquant.schemes.Mask` (int32 ``[B]`` ``q_lens`` / ``kv_start``,
            fp32 ``[Hq]`` finite ``sinks``).
        first: a :class:`~kvquant.schemes.FirstTokens` (a K transform's side buffer), or None.
        out: ``[B, Lq, Hq, D]`` in the query dtype, or None.
        recent: a :class:`~kvquant.schemes.RecentTokens` (the newest tokens' ring), or None.

    Returns:
        The call's sizes.

    Raises:
        KernelInputError: any argument is malformed.
    """
    geo = check_attention_structure(
        query, pages, block_tables, seq_lens, scheme, sm_scale=sm_scale, mask=mask,
        first=first, out=out, recent=recent,
    )  # fmt: skip
    checked = cast("tuple[Pages, torch.Tensor, torch.Tensor, Mask, FirstTokens | None]",
                   (pages, block_tables, seq_lens, mask, first))  # fmt: skip
    check_attention_values(*checked, geo)
    return geo

"""Argument checks shared by kvquant's kernel entry points (both ops' checks build on them).

Every check raises :class:`~kvquant.errors.KernelInputError` naming the tensor, what was found,
what was expected and how to fix it; nothing here copies, casts or makes a tensor contiguous.
Metadata checks never synchronise the GPU; checks of tensor values run on CPU tensors, or
everywhere with ``KVQUANT_CHECK_VALUES=1`` (:func:`value_checks_enabled`). A scheme's own
values were checked when it was built (:mod:`kvquant.schemes`); here its tensors are checked
against the call's pages. Metadata checks run once per plan (:mod:`kvquant.kernels.plan`,
which keys plans by :func:`signature`); value checks on every run.
The op-specific checks: :mod:`kvquant.kernels.write.validate`,
:mod:`kvquant.kernels.attention.validate`; the contract in full: docs/dev/kernels.md.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Any, cast

import torch

from kvquant.errors import KernelInputError
from kvquant.schemes import SCALE_MAX, SCALE_MIN, KernelView, Pages, RecentTokens, Scheme

__all__ = [
    "FP8_DTYPES",
    "INPUT_DTYPES",
    "SCALE_MAX",
    "SCALE_MIN",
    "check_fp4_pages",
    "check_new_tokens",
    "check_recent_tokens",
    "check_recent_write",
    "check_scheme_tensors",
    "check_sink_values",
    "check_slot_mapping_inputs",
    "signature",
    "unpack",
    "value_checks_enabled",
]

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
"""Page dtypes the kernels store."""

INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes accepted for new K/V and for queries."""

_SCALE_FIX = (
    "Fix: normalise scales with kvquant.registry (it returns fp32 [] or [num_kv_heads] "
    "tensors on the cache's device)."
)


def value_checks_enabled(device: torch.device) -> bool:
    """Whether checks that read tensor values run for tensors on ``device``.

    True on CPU; on other devices only with ``KVQUANT_CHECK_VALUES=1`` (they
    would synchronise the GPU on every call).
    """
    return device.type == "cpu" or os.environ.get("KVQUANT_CHECK_VALUES", "0") == "1"


def check_new_tokens(
    op: str,
    key: object,
    value: object,
    slot_mapping: object,
    pages_shape: tuple[int, ...],
    device: torch.device,
) -> tuple[int, int]:
    """The new K/V ``[B, L, Hkv, D]`` and their int64 ``slot_mapping [B, L]`` of a cache write,
    against the pages' ``Hkv`` and ``D`` (``pages_shape[2:]``) and device; returns ``(B, L)``."""
    hkv, d = pages_shape[2], pages_shape[3]
    k = require_tensor(op, "key", key)
    v = require_tensor(op, "value", value)
    layout = "[batch, new_tokens, num_kv_heads, head_dim]"
    check_ndim(op, "key", k, 4, layout)
    in_fix = "cast new K/V to float32, float16 or bfloat16."
    check_dtype(op, "key", k, INPUT_DTYPES, in_fix)
    check_dtype(op, "value", v, INPUT_DTYPES, in_fix)
    bsz, seq = k.shape[0], k.shape[1]
    check_shape(op, "key", k, (bsz, seq, hkv, d), f"{layout} matching the pages' Hkv and D")
    check_shape(op, "value", v, (bsz, seq, hkv, d), f"{layout}, the shape of key")
    sm = require_tensor(op, "slot_mapping", slot_mapping)
    fix = (
        "build it with kvquant.cache.PageAllocator.reserve or kvquant.kernels.compute_slot_mapping."
    )
    check_dtype(op, "slot_mapping", sm, (torch.int64,), fix)
    check_shape(op, "slot_mapping", sm, (bsz, seq), "[batch, new_tokens] of key")
    for name, t in (("key", k), ("value", v), ("slot_mapping", sm)):
        check_device(op, name, t, device, "k_pages")
    return bsz, seq


def fail(msg: str) -> KernelInputError:
    return KernelInputError(msg)


def check_recent_tokens(
    op: str, recent: object, bsz: int, hkv: int, d: int, device: torch.device
) -> None:
    """Structure of the ring of the newest tokens: a RecentTokens of one contiguous
    ``[B, 2, R, Hkv, D]`` tensor (``R >= 1``) in the model's dtypes, on the pages' device."""
    if recent is None:
        return
    if not isinstance(recent, RecentTokens):
        raise fail(
            f"{op}: recent is a {type(recent).__name__}; expected kvquant.schemes.RecentTokens "
            "or None. Fix: pass RecentTokens(recent_kv)."
        )
    kv = require_tensor(op, "recent_kv", recent.kv)
    layout = "[batch, 2 (K, V), ring, num_kv_heads, head_dim]"
    check_ndim(op, "recent_kv", kv, 5, layout)
    fix = "keep the newest tokens' K (the pages' frame) and V in the model dtype."
    check_dtype(op, "recent_kv", kv, INPUT_DTYPES, fix)
    ring = max(int(kv.shape[2]), 1)
    check_shape(op, "recent_kv", kv, (bsz, 2, ring, hkv, d), f"{layout} of the query and pages")
    check_device(op, "recent_kv", kv, device, "k_pages")
    if not kv.is_contiguous():
        raise fail(
            f"{op}: recent_kv has strides {kv.stride()} for shape {tuple(kv.shape)}; expected "
            "it contiguous (the kernels find each sequence's values' ring after its keys'). Fix: allocate "
            "the ring once with torch.empty(batch, 2, ring, num_kv_heads, head_dim)."
        )


def check_recent_write(
    op: str,
    recent: object,
    recent_start: object,
    new_tokens: tuple[int, int, int, int],
    device: torch.device,
    written: list[tuple[str, Any]],
) -> None:
    """A write's ring of the newest tokens (``recent``) and the position of its first new token
    (``recent_start``, int64 ``[1]`` on the pages' device): both or neither; the ring holds at
    least the ``L`` new tokens of ``new_tokens`` ``(B, L, Hkv, D)`` (each its own slot) and
    shares no memory with the ``written`` tensors."""
    if recent is None and recent_start is None:
        return
    if recent is None or recent_start is None:
        given, missing = ("recent", "recent_start") if recent_start is None else (
            "recent_start", "recent")  # fmt: skip
        raise fail(
            f"{op}: {given} was given without {missing}; expected both (a ring and the position "
            f"of the first new token) or neither. Fix: pass {missing} too, or drop {given}."
        )
    bsz, seq, hkv, d = new_tokens
    check_recent_tokens(op, recent, bsz, hkv, d, device)
    kv = cast(RecentTokens, recent).kv
    if int(kv.shape[2]) < seq:
        raise fail(
            f"{op}: {seq} new tokens per sequence for a ring of {int(kv.shape[2])} newest "
            f"tokens; expected at most {int(kv.shape[2])} (each new token takes its own slot of "
            "the ring). Fix: write longer runs without recent and copy their newest tokens into "
            "the ring separately."
        )
    start = require_tensor(op, "recent_start", recent_start)
    check_dtype(op, "recent_start", start, (torch.int64,), "pass an int64 [1] tensor.")
    check_shape(op, "recent_start", start, (1,), "[1]: the position of every row's first new token")
    check_device(op, "recent_start", start, device, "k_pages")
    check_disjoint(op, [*written, ("recent_kv", kv)])


def require_tensor(op: str, name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise fail(f"{op}: {name} is a {type(x).__name__}; expected a torch.Tensor.")
    return x


def check_dtype(
    op: str, name: str, x: torch.Tensor, allowed: Sequence[torch.dtype], fix: str
) -> None:
    if x.dtype not in allowed:
        want = " or ".join(str(d) for d in allowed)
        raise fail(f"{op}: {name} has dtype {x.dtype}; expected {want}. Fix: {fix}")


def check_shape(op: str, name: str, x: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(x.shape) != expected:
        raise fail(
            f"{op}: {name} has shape {tuple(x.shape)}; expected {expected} ({what}). "
            f"Fix: pass {name} with that shape."
        )


def check_ndim(op: str, name: str, x: torch.Tensor, ndim: int, layout: str) -> None:
    if x.dim() != ndim:
        raise fail(
            f"{op}: {name} has {x.dim()} dims (shape {tuple(x.shape)}); expected {ndim} dims "
            f"{layout}. Fix: pass {name} in that layout."
        )


def check_device(op: str, name: str, x: torch.Tensor, device: torch.device, ref: str) -> None:
    if x.device != device:
        raise fail(
            f"{op}: {name} is on {x.device} but {ref} is on {device}; all tensors of one call "
            f"must share a device. Fix: move {name} to {device} once, when it is created."
        )


def overlaps(x: torch.Tensor) -> bool:
    """Whether two elements of ``x`` may share memory (dims ordered by stride, each clear of the rest)."""
    reach = 0  # largest offset reachable through the smaller-stride dims
    for stride, size in sorted((s, n) for s, n in zip(x.stride(), x.shape, strict=True) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _check_written_layout(
    op: str, name: str, x: torch.Tensor, *, helper: str, last_dim_contiguous: bool
) -> None:
    """A tensor a kernel writes into: no element aliasing another (and, if asked, unit last stride)."""
    strided_last = last_dim_contiguous and x.shape[-1] > 1 and x.stride(-1) != 1
    aliased = overlaps(x)
    if strided_last or aliased:
        found = ", so that elements share memory" if aliased else ", a strided last dimension"
        expected = "no two elements sharing memory"
        if last_dim_contiguous:
            expected = "the last dimension contiguous and " + expected
        raise fail(
            f"{op}: {name} is written in place but has strides {x.stride()} for shape "
            f"{tuple(x.shape)}{found}; expected {expected} (kvquant never copies a tensor it "
            f"writes into). Fix: allocate it with kvquant.kernels.{helper} "
            "(kvquant.cache.PagedLayerStorage does), or torch.zeros in the documented shape."
        )


def _byte_range(x: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` bytes of memory that ``x`` can touch."""
    if x.numel() == 0:
        return 0, 0
    span = sum(st * (n - 1) for st, n in zip(x.stride(), x.shape, strict=True)) + 1
    start = x.data_ptr()
    return start, start + span * x.element_size()


def _period(x: torch.Tensor) -> tuple[int, int] | None:
    """``(P, w)`` when ``x``'s memory is runs of ``w`` bytes repeating every ``P`` bytes, else None.

    That is the layout of one layer's pages inside a buffer that interleaves
    every layer's pages block by block: the largest stride (in bytes) is the
    period ``P`` and everything else stays inside one period.
    """
    dims = sorted(
        (st * x.element_size(), n) for st, n in zip(x.stride(), x.shape, strict=True) if n > 1
    )
    if len(dims) < 2:
        return None
    period = dims[-1][0]
    width = sum(st * (n - 1) for st, n in dims[:-1]) + x.element_size()
    return (period, width) if width <= period else None


def _interleaved_apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` repeat with one period and their runs never meet (disjoint)."""
    pa, pb = _period(a), _period(b)
    if pa is None or pb is None or pa[0] != pb[0]:
        return False
    period = pa[0]
    da = (a.data_ptr() - b.data_ptr()) % period  # a's run start, relative to b's, on the circle
    # b's run covers [0, wb); a's run covers [da, da + wa) modulo the period
    return da >= pb[1] and da + pa[1] <= period


def check_disjoint(op: str, written: list[tuple[str, Any]]) -> None:
    """Tensors written by one call must not share memory (one would overwrite the other).

    Two views of one buffer whose byte ranges overlap pass when they interleave
    with a common period and their runs never meet (:func:`_interleaved_apart`).
    """
    ranges = [(name, *_byte_range(x), x) for name, x in written if x.numel()]
    for i, (a, a0, a1, ta) in enumerate(ranges):
        for b, b0, b1, tb in ranges[i + 1 :]:
            if a0 < b1 and b0 < a1 and not _interleaved_apart(ta, tb):
                raise fail(
                    f"{op}: {a} and {b} share memory; each is written in place, so one "
                    f"would overwrite the other. Fix: allocate them separately "
                    "(kvquant.cache.PagedLayerStorage does)."
                )


def _check_static_scale(
    op: str, name: str, s: torch.Tensor, hkv: int, device: torch.device
) -> None:
    check_dtype(op, name, s, (torch.float32,), _SCALE_FIX)
    if tuple(s.shape) not in ((), (hkv,)):
        raise fail(
            f"{op}: {name} has shape {tuple(s.shape)}; expected () (per-tensor) or ({hkv},) "
            f"(per-head, the pages have {hkv} KV heads). {_SCALE_FIX}"
        )
    check_device(op, name, s, device, "k_pages")


_sinks_ok: dict[tuple[object, ...], weakref.ref[torch.Tensor]] = {}
_SINKS_MAX = 64


def _version(x: torch.Tensor) -> int:
    try:
        return int(x._version)
    except RuntimeError:  # an inference tensor: no version counter (not written outside it)
        return -1


def check_sink_values(op: str, name: str, sinks: torch.Tensor) -> None:
    """Refuse attention-sink logits holding a non-finite value.

    The values are read once per tensor object and version (a GPU syncs once);
    later calls with the same, unmodified tensor skip the read.

    Raises:
        KernelInputError: naming the first bad element and its value.
    """
    key = (id(sinks), sinks.data_ptr(), _version(sinks), sinks.device, tuple(sinks.shape))
    seen = _sinks_ok.get(key)
    if seen is not None and seen() is sinks:
        return
    flat = sinks.detach().reshape(-1)
    ok = torch.isfinite(flat)
    if not bool(ok.all()):
        index = int((~ok).nonzero()[0, 0])
        raise fail(
            f"{op}: {name} element {index} is {float(flat[index])!r}; expected finite "
            "attention-sink logits. Fix: pass the model's sinks (module.sinks) as fp32."
        )
    if len(_sinks_ok) >= _SINKS_MAX:
        _sinks_ok.clear()
    _sinks_ok[key] = weakref.ref(sinks)


def unpack(op: str, pages: object, scheme: object) -> tuple[Pages, KernelView]:
    """The call's :class:`~kvquant.schemes.Pages` and what the kernels read from its scheme.

    Raises:
        KernelInputError: ``pages`` or ``scheme`` is not one; a static scheme with group
            scales beside the pages, or a dynamic one without them.
    """
    if not isinstance(pages, Pages):
        raise fail(
            f"{op}: pages is a {type(pages).__name__}; expected kvquant.schemes.Pages. "
            "Fix: pass Pages(k_pages, v_pages) (and the group scales of a GroupScales scheme)."
        )
    if not isinstance(scheme, Scheme):
        raise fail(
            f"{op}: scheme is a {type(scheme).__name__}; expected a kvquant.schemes scheme "
            "(PerTensorScales, PerHeadScales, GroupScales, KTransformScales). Fix: build one "
            "(kvquant.registry resolves the model's)."
        )
    view = scheme.kernel_view()
    groups = (pages.k_scales is not None, pages.v_scales is not None)
    if view.k_fp4 is not None or view.v_fp4 is not None:
        for side, fmt, given in (("k", view.k_fp4, groups[0]), ("v", view.v_fp4, groups[1])):
            if fmt is not None and not given:
                raise fail(
                    f"{op}: Pages.{side}_scales is None but the scheme {scheme.name!r} stores "
                    f"{side.upper()} in {fmt.name}, whose block scales are kept beside the "
                    "pages; expected them. Fix: allocate pages and block scales with "
                    "kvquant.kernels.fp4.fp4_page_storage."
                )
            if fmt is None and given:
                raise fail(
                    f"{op}: Pages.{side}_scales was given but the scheme {scheme.name!r} stores "
                    f"{side.upper()} in FP8 with a static scale; expected None. Fix: drop it."
                )
        return pages, view
    if scheme.dynamic and not all(groups):
        missing = "v_group_scales" if groups[0] else "k_group_scales"
        raise fail(
            f"{op}: {missing} (Pages.{missing[0]}_scales) is None but the scheme is "
            f"{scheme.name!r}, whose scales are stored beside the pages; expected both. Fix: "
            "allocate them with kvquant.kernels.group_scale_storage."
        )
    if not scheme.dynamic and any(groups):
        raise fail(
            f"{op}: both static scales and group scales were given (a {scheme.name!r} scheme "
            "and Pages.k_scales / v_scales); expected one kind. Fix: drop the group scales "
            "from Pages, or pass a GroupScales scheme."
        )
    return pages, view


def check_scheme_tensors(
    op: str,
    pages: Pages,
    view: KernelView,
    geometry: tuple[int, int, int, int],
    device: torch.device,
    group_scales_written: bool,
) -> int | None:
    """The scheme's tensors (and group scales) against the pages: shapes, device; G or None.

    Dtypes and values were checked when the scheme was built; here only what depends on the
    call: the pages' ``Hkv`` and ``D``, their device, the group scales' layout; a K rotation
    (the k-transform's, or fp32-group scales') ``[D, D]`` on the pages' device.
    """
    num_pages, page_size, hkv, d = geometry
    for name, x, shape, what in (
        ("k_offset", view.k_offset, (hkv, d), "one offset per KV head and channel"),
        ("k_rotation", view.k_rotation, (d, d), "an orthonormal [head_dim, head_dim] rotation"),
    ):
        if x is not None:
            check_shape(op, name, x, shape, f"{what}, for the pages' Hkv and D")
            check_device(op, name, x, device, "k_pages")
    if view.group_size is None:
        for name, s in (("k_scale", view.k_scale), ("v_scale", view.v_scale)):
            _check_static_scale(op, name, require_tensor(op, name, s), hkv, device)
        return None
    kg = require_tensor(op, "k_group_scales", pages.k_scales)
    vg = require_tensor(op, "v_group_scales", pages.v_scales)
    layout = "[num_pages, page_size, num_kv_heads, head_dim // group_size]"
    check_ndim(op, "k_group_scales", kg, 4, layout)
    n_groups = kg.shape[-1]
    if n_groups < 1 or d % n_groups != 0:
        raise fail(
            f"{op}: k_group_scales has {n_groups} groups per head in its last dim, which does "
            f"not divide head_dim {d}; expected head_dim // group_size with group_size dividing "
            f"{d}. Fix: choose a group_size that divides the head dim."
        )
    if n_groups * view.group_size != d:
        raise fail(
            f"{op}: k_group_scales has {n_groups} groups per head but the scheme's group_size "
            f"{view.group_size} makes {d // view.group_size} of head_dim {d}; expected the "
            "same. Fix: allocate the group scales for the scheme's group_size."
        )
    expected = (num_pages, page_size, hkv, n_groups)
    for name, g in (("k_group_scales", kg), ("v_group_scales", vg)):
        check_dtype(
            op, name, g, (torch.float32,), "allocate fp32 group scales (PagedLayerStorage does)."
        )
        check_shape(op, name, g, expected, f"{layout} of the pages")
        check_device(op, name, g, device, "k_pages")
        if group_scales_written:
            _check_written_layout(
                op, name, g, helper="group_scale_storage", last_dim_contiguous=True
            )
    return view.group_size


def check_fp4_pages(
    op: str,
    pages: Pages,
    view: KernelView,
    head_dim: int,
    *,
    written: bool,
) -> tuple[int, int, int, int]:
    """The pages, block scales and static scales of a 4-bit scheme (:class:`~kvquant.schemes.
    Fp4Scales`); returns ``(num_pages, page_size, Hkv, D)``.

    A 4-bit side: uint8 pages ``[P, S, Hkv, D // 2]`` and block scales ``[P, S, Hkv,
    D // block]`` of the format's dtype, both with their last dimension contiguous (the
    kernels read rows of bytes); an FP8 side: FP8 pages ``[P, S, Hkv, D]``, any strides. The
    static scales (FP8 scale or NVFP4 global scale) are ``[]`` or ``[Hkv]``.
    """
    alloc = "allocate them with kvquant.kernels.fp4.fp4_page_storage (PagedLayerStorage does)."
    layout = "[num_pages, page_size, num_kv_heads, head_dim (// 2)]"
    kp = require_tensor(op, "k_pages", pages.k)
    check_ndim(op, "k_pages", kp, 4, layout)
    geometry: tuple[int, int, int] = (kp.shape[0], kp.shape[1], kp.shape[2])
    device = kp.device
    sides = (
        ("k", pages.k, pages.k_scales, view.k_fp4, view.k_scale),
        ("v", pages.v, pages.v_scales, view.v_fp4, view.v_scale),
    )
    for side, x, blocks, fmt, static in sides:
        name = f"{side}_pages"
        t = require_tensor(op, name, x)
        check_ndim(op, name, t, 4, layout)
        check_device(op, name, t, device, "k_pages")
        if fmt is None:
            check_dtype(op, name, t, FP8_DTYPES, "allocate FP8 pages with page_storage.")
            want: tuple[int, ...] = (*geometry, head_dim)
            check_shape(op, name, t, want, "the pages' geometry and the scheme's head_dim")
            if written:
                _check_written_layout(op, name, t, helper="page_storage", last_dim_contiguous=False)
        else:
            check_dtype(op, name, t, (torch.uint8,), f"{alloc} (two e2m1 codes per byte)")
            want = (*geometry, head_dim // 2)
            check_shape(op, name, t, want, "two e2m1 codes per byte, for the scheme's head_dim")
            bname = f"{side}_block_scales"
            b = require_tensor(op, bname, blocks)
            check_dtype(op, bname, b, (fmt.scale_dtype,), f"{alloc} ({fmt.name})")
            check_shape(op, bname, b, (*geometry, head_dim // fmt.block_size),
                        f"one {fmt.name} scale per block of {fmt.block_size}")  # fmt: skip
            check_device(op, bname, b, device, "k_pages")
            for label, u in ((name, t), (bname, b)):
                if written:
                    _check_written_layout(
                        op, label, u, helper="fp4.fp4_page_storage", last_dim_contiguous=True
                    )
                elif u.shape[-1] > 1 and u.stride(-1) != 1:
                    raise fail(
                        f"{op}: {label} has strides {u.stride()} for shape {tuple(u.shape)}; "
                        f"expected its last dimension contiguous (the kernels read each "
                        f"token's bytes as one row). Fix: {alloc}"
                    )
        if static is not None:
            label = f"{side}_scale" if fmt is None else f"{side}_global_scale"
            _check_static_scale(op, label, static, geometry[2], device)
    for name, tr, shape, what in (  # FP8 K in the k-transform's frame
        ("k_offset", view.k_offset, (geometry[2], head_dim), "one offset per KV head and channel"),
        ("k_rotation", view.k_rotation, (head_dim, head_dim), "an orthonormal [D, D] rotation"),
    ):
        if tr is not None:
            check_shape(op, name, tr, shape, f"{what}, for the pages' Hkv and D")
            check_device(op, name, tr, device, "k_pages")
    return (*geometry, head_dim)


def check_pages(
    op: str, k_pages: object, v_pages: object, *, written: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    kp = require_tensor(op, "k_pages", k_pages)
    vp = require_tensor(op, "v_pages", v_pages)
    layout = "[num_pages, page_size, num_kv_heads, head_dim]"
    check_ndim(op, "k_pages", kp, 4, layout)
    page_fix = "allocate pages as torch.float8_e4m3fn (default) or torch.float8_e5m2."
    check_dtype(op, "k_pages", kp, FP8_DTYPES, page_fix)
    check_dtype(op, "v_pages", vp, FP8_DTYPES, page_fix)
    if vp.dtype != kp.dtype:
        raise fail(
            f"{op}: v_pages has dtype {vp.dtype} but k_pages has {kp.dtype}; expected one FP8 "
            "format for both caches. Fix: allocate K and V pages with the same kv_dtype."
        )
    check_shape(op, "v_pages", vp, tuple(kp.shape), "the shape of k_pages")
    check_device(op, "v_pages", vp, kp.device, "k_pages")
    if written:
        for name, x in (("k_pages", kp), ("v_pages", vp)):
            _check_written_layout(op, name, x, helper="page_storage", last_dim_contiguous=False)
    return kp, vp


def check_index_vector(
    op: str, name: str, x: object, bsz: int, device: torch.device
) -> torch.Tensor:
    t = require_tensor(op, name, x)
    check_dtype(op, name, t, (torch.int32,), f"build {name} with .to(torch.int32) once per step.")
    check_shape(op, name, t, (bsz,), "one entry per sequence")
    check_device(op, name, t, device, "k_pages")
    return t


# ------------------------------------------------------------ signatures

_STRIDED = torch.strided


def signature(*args: object) -> tuple[object, ...] | None:
    """Everything the structural checks read from ``args``, as a hashable key.

    A tensor contributes its shape, strides, dtype and device (contiguity
    follows from shape and strides; a write's signature adds the addresses of the tensors
    it writes: :func:`~kvquant.kernels.write.validate.write_signature`); None stays None; a
    bool, int or float (a scalar option) contributes its type and value. Returns None (no
    plan can be reused) when an argument is anything else, or a tensor that is not strided
    (sparse, nested): such calls run every check each time.
    """
    key: list[object] = []
    try:
        for x in args:
            if isinstance(x, torch.Tensor):
                if x.layout is not _STRIDED:
                    return None
                key.append((x.shape, x.stride(), x.dtype, x.device))
            elif x is None:
                key.append(None)
            elif type(x) in (bool, int, float):
                key.append((type(x), x))
            else:
                return None
    except RuntimeError:  # no strides
        return None
    return tuple(key)


def address(x: object) -> int | None:
    return x.data_ptr() if isinstance(x, torch.Tensor) else None


def check_slot_mapping_inputs(block_tables: object, positions: object, page_size: object) -> None:
    """Validate the arguments of :func:`kvquant.kernels.compute_slot_mapping`.

    Shapes, dtypes and devices always; that every position lies inside the
    pages the block table lists where values are cheap to read (see the module
    docstring).

    Raises:
        KernelInputError: any argument is malformed.
    """
    op = "compute_slot_mapping"
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise fail(
            f"{op}: page_size is {page_size!r}; expected an int >= 1 (the cache's token slots "
            "per page). Fix: pass the page size the block table was built with."
        )
    bt = require_tensor(op, "block_tables", block_tables)
    check_ndim(op, "block_tables", bt, 2, "[batch, max_pages]")
    check_dtype(op, "block_tables", bt, (torch.int32, torch.int64), "pass an integer block table.")
    pos = require_tensor(op, "positions", positions)
    check_ndim(op, "positions", pos, 2, "[batch, new_tokens]")
    if pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
        raise fail(
            f"{op}: positions has dtype {pos.dtype}; expected an integer dtype (token positions). "
            "Fix: build positions with torch.arange(..., dtype=torch.int64)."
        )
    if pos.shape[0] != bt.shape[0]:
        raise fail(
            f"{op}: positions has {pos.shape[0]} rows but block_tables has {bt.shape[0]}; "
            "expected one row per sequence. Fix: pass positions of the same sequences."
        )
    check_device(op, "positions", pos, bt.device, "block_tables")
    if pos.numel() and value_checks_enabled(bt.device):
        top = int(pos.max())
        if top >= bt.shape[1] * page_size:
            raise fail(
                f"{op}: positions holds {top}, but block_tables lists {bt.shape[1]} pages of "
                f"{page_size} slots per sequence (positions 0..{bt.shape[1] * page_size - 1}; "
                "negative means padding). Fix: reserve the pages first, and pass the block table "
                "that lists them."
            )

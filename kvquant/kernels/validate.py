"""Argument checks shared by kvquant's kernel entry points.

Every check raises :class:`~kvquant.errors.KernelInputError` with a message
that names the tensor, says what was found and what was expected, and how to
fix it. Nothing here copies, casts or makes a tensor contiguous: a tensor a
kernel writes into (pages, group scales, ``out``) must already have the
required layout, otherwise the call is rejected.

**Value checks and GPU syncs.** Checks of dtypes, shapes, devices and strides
read only tensor metadata and never synchronise the GPU. Checks that need
tensor *values* (slots inside the cache, block-table entries inside the page
range, lengths inside the block table) would force a device-to-host copy on
every call, so they run only when the tensors are on the CPU (where they cost
little and the torch backend would index out of range anyway) or when the
environment sets ``KVQUANT_CHECK_VALUES=1`` (debugging on a GPU). On CUDA
without that variable, the Triton write kernel still never stores outside the
pages: it skips slots outside ``[0, num_pages * page_size)``.

**Scale values.** Static scales (``k_scale`` / ``v_scale``) must hold finite
values in ``[SCALE_MIN, SCALE_MAX]`` (the registry's bounds): a zero, negative,
NaN, infinite or subnormal scale would store or read garbage. The values are
read once per scale tensor (one sync on a GPU) and remembered while the same
tensor object holds the same data (its version counter), so a decode loop over
a cache's scales pays a dictionary lookup.

**K transform.** ``k_offset`` (fp32 ``[Hkv, D]``) and ``k_rotation`` (fp32 ``[D, D]``) of
the ``k-transform`` format need static scales; their values must be finite (read once per
tensor object and version, like scales). That ``k_rotation`` is orthonormal is the caller's
promise (checked once where it enters storage, not per call). The first-token side buffer
(``first_k``, ``first_v`` ``[B, NF, Hkv, D]`` float and ``first_lens`` int32 ``[B]``) is given
all together or not at all, with static scales; ``first_lens[b] <= NF`` and
``kv_start[b] + first_lens[b] <= seq_lens[b]`` are value checks.

**Repeated calls.** The metadata checks of :func:`check_write_inputs` and
:func:`check_attention_inputs` are remembered once they pass, keyed on
everything they read (each tensor's shape, strides, dtype and device, the
addresses of the tensors a write stores into, the None-ness of optional
tensors, the type and value of scalar options): a
decode loop pays for a dictionary lookup instead of the checks, and any
argument that differs in something checked runs them again. Failures are
never remembered, and the value checks (where enabled) run on every call.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kvquant.errors import KernelInputError

__all__ = [
    "FP8_DTYPES",
    "INPUT_DTYPES",
    "SCALE_MAX",
    "SCALE_MIN",
    "AttentionGeometry",
    "WriteGeometry",
    "check_attention_inputs",
    "check_finite_values",
    "check_scale_values",
    "check_slot_mapping_inputs",
    "check_write_inputs",
    "clear_check_memo",
    "value_checks_enabled",
]

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
"""Page dtypes the kernels store."""

INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes accepted for new K/V and for queries."""

SCALE_MIN = 2.0**-117
"""Smallest static scale accepted (the registry's ``MIN_SCALE``: 1/scale and the smallest
code times scale stay normal fp32 numbers)."""

SCALE_MAX = 2.0**100
"""Largest static scale accepted (the registry's ``MAX_SCALE``)."""

_SCALE_FIX = (
    "Fix: normalise scales with kvquant.registry (it returns fp32 [] or [num_kv_heads] "
    "tensors on the cache's device)."
)


@dataclass(frozen=True)
class WriteGeometry:
    """Sizes read from validated :func:`~kvquant.kernels.write_kv` arguments.

    Attributes:
        batch: ``B``.
        seq: ``L`` (new tokens per sequence).
        num_pages: pages in the cache.
        page_size: token slots per page.
        num_kv_heads: ``Hkv``.
        head_dim: ``D``.
        group_size: ``G`` for dynamic group scales, ``None`` for static scales.
    """

    batch: int
    seq: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    group_size: int | None


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


def value_checks_enabled(device: torch.device) -> bool:
    """Whether checks that read tensor values run for tensors on ``device``.

    True on CPU; on other devices only with ``KVQUANT_CHECK_VALUES=1`` (they
    would synchronise the GPU on every call).
    """
    return device.type == "cpu" or os.environ.get("KVQUANT_CHECK_VALUES", "0") == "1"


def _fail(msg: str) -> KernelInputError:
    return KernelInputError(msg)


def _require_tensor(op: str, name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise _fail(f"{op}: {name} is a {type(x).__name__}; expected a torch.Tensor.")
    return x


def _check_dtype(
    op: str, name: str, x: torch.Tensor, allowed: Sequence[torch.dtype], fix: str
) -> None:
    if x.dtype not in allowed:
        want = " or ".join(str(d) for d in allowed)
        raise _fail(f"{op}: {name} has dtype {x.dtype}; expected {want}. Fix: {fix}")


def _check_shape(op: str, name: str, x: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(x.shape) != expected:
        raise _fail(
            f"{op}: {name} has shape {tuple(x.shape)}; expected {expected} ({what}). "
            f"Fix: pass {name} with that shape."
        )


def _check_ndim(op: str, name: str, x: torch.Tensor, ndim: int, layout: str) -> None:
    if x.dim() != ndim:
        raise _fail(
            f"{op}: {name} has {x.dim()} dims (shape {tuple(x.shape)}); expected {ndim} dims "
            f"{layout}. Fix: pass {name} in that layout."
        )


def _check_device(op: str, name: str, x: torch.Tensor, device: torch.device, ref: str) -> None:
    if x.device != device:
        raise _fail(
            f"{op}: {name} is on {x.device} but {ref} is on {device}; all tensors of one call "
            f"must share a device. Fix: move {name} to {device} once, when it is created."
        )


def _overlaps(x: torch.Tensor) -> bool:
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
    overlaps = _overlaps(x)
    if strided_last or overlaps:
        found = ", so that elements share memory" if overlaps else ", a strided last dimension"
        expected = "no two elements sharing memory"
        if last_dim_contiguous:
            expected = "the last dimension contiguous and " + expected
        raise _fail(
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


def _check_disjoint(op: str, written: list[tuple[str, Any]]) -> None:
    """Tensors written by one call must not share memory (one would overwrite the other).

    Two views of one buffer whose byte ranges overlap pass when they interleave
    with a common period and their runs never meet (:func:`_interleaved_apart`).
    """
    ranges = [(name, *_byte_range(x), x) for name, x in written if x.numel()]
    for i, (a, a0, a1, ta) in enumerate(ranges):
        for b, b0, b1, tb in ranges[i + 1 :]:
            if a0 < b1 and b0 < a1 and not _interleaved_apart(ta, tb):
                raise _fail(
                    f"{op}: {a} and {b} share memory; each is written in place, so one "
                    f"would overwrite the other. Fix: allocate them separately "
                    "(kvquant.cache.PagedLayerStorage does)."
                )


def _check_static_scale(
    op: str, name: str, s: torch.Tensor, hkv: int, device: torch.device
) -> None:
    _check_dtype(op, name, s, (torch.float32,), _SCALE_FIX)
    if tuple(s.shape) not in ((), (hkv,)):
        raise _fail(
            f"{op}: {name} has shape {tuple(s.shape)}; expected () (per-tensor) or ({hkv},) "
            f"(per-head, the pages have {hkv} KV heads). {_SCALE_FIX}"
        )
    _check_device(op, name, s, device, "k_pages")


_scale_values_ok: dict[tuple[object, ...], weakref.ref[torch.Tensor]] = {}


def _version(x: torch.Tensor) -> int:
    try:
        return int(x._version)
    except RuntimeError:  # an inference tensor: no version counter (not written outside it)
        return -1


def check_scale_values(op: str, name: str, scale: torch.Tensor, *, sinks: bool = False) -> None:
    """Refuse a static scale holding a value outside ``[SCALE_MIN, SCALE_MAX]`` (or NaN).

    The values are read once per tensor object and version (a GPU syncs once);
    later calls with the same, unmodified tensor skip the read.

    Args:
        op: the entry point, for the message.
        name: the argument, for the message.
        scale: the tensor.
        sinks: check attention-sink logits instead: any finite value.

    Raises:
        KernelInputError: naming the first bad element, its value and the range.
    """
    key = (id(scale), scale.data_ptr(), _version(scale), scale.device, tuple(scale.shape), sinks)
    seen = _scale_values_ok.get(key)
    if seen is not None and seen() is scale:
        return
    flat = scale.detach().reshape(-1)
    ok = torch.isfinite(flat)
    if not sinks:
        ok &= (flat >= SCALE_MIN) & (flat <= SCALE_MAX)
    if not bool(ok.all()):
        index = int((~ok).nonzero()[0, 0])
        if sinks:
            raise _fail(
                f"{op}: {name} element {index} is {float(flat[index])!r}; expected finite "
                "attention-sink logits. Fix: pass the model's sinks (module.sinks) as fp32."
            )
        raise _fail(
            f"{op}: {name} element {index} is {float(flat[index])!r}; expected finite "
            f"dequantization multipliers in [{SCALE_MIN:.3g}, {SCALE_MAX:.3g}] (amax / 448): a "
            f"zero, negative, NaN, infinite or subnormal scale stores or reads garbage. "
            f"{_SCALE_FIX}"
        )
    if len(_scale_values_ok) >= _MEMO_MAX:
        _scale_values_ok.clear()
    _scale_values_ok[key] = weakref.ref(scale)


_finite_ok: dict[tuple[object, ...], weakref.ref[torch.Tensor]] = {}


def check_finite_values(op: str, name: str, x: torch.Tensor, fix: str) -> None:
    """Refuse a tensor holding a non-finite value (read once per tensor object and version).

    Args:
        op: the entry point, for the message.
        name: the argument, for the message.
        x: the tensor (e.g. ``k_offset``, ``k_rotation``).
        fix: the message's fix.

    Raises:
        KernelInputError: naming the first bad element and its value.
    """
    key = (id(x), x.data_ptr(), _version(x), x.device, tuple(x.shape))
    seen = _finite_ok.get(key)
    if seen is not None and seen() is x:
        return
    flat = x.detach().reshape(-1)
    ok = torch.isfinite(flat)
    if not bool(ok.all()):
        index = int((~ok).nonzero()[0, 0])
        raise _fail(
            f"{op}: {name} element {index} (of shape {tuple(x.shape)}) is "
            f"{float(flat[index])!r}; expected finite values. Fix: {fix}"
        )
    if len(_finite_ok) >= _MEMO_MAX:
        _finite_ok.clear()
    _finite_ok[key] = weakref.ref(x)


_TRANSFORM_FIX = (
    "build k_offset [num_kv_heads, head_dim] and k_rotation [head_dim, head_dim] as fp32 "
    "tensors on the cache's device (kvquant.kernels.hadamard(head_dim) for the rotation)."
)


def _check_k_transform(
    op: str,
    k_offset: object,
    k_rotation: object,
    group_size: int | None,
    hkv: int,
    d: int,
    device: torch.device,
) -> None:
    """Structure of the static K transform: fp32 offset ``[Hkv, D]``, rotation ``[D, D]``."""
    if k_offset is None and k_rotation is None:
        return
    if group_size is not None:
        raise _fail(
            f"{op}: a K transform (k_offset / k_rotation) was given with fp32 group scales; "
            "expected static k_scale and v_scale (per-tensor or per-head): the k-transform "
            "format offsets K before a fixed scale. Fix: pass k_scale and v_scale, or drop "
            "k_offset and k_rotation."
        )
    for name, x, shape, what in (
        ("k_offset", k_offset, (hkv, d), "one offset per KV head and channel, rotated frame"),
        ("k_rotation", k_rotation, (d, d), "an orthonormal [head_dim, head_dim] rotation"),
    ):
        if x is None:
            continue
        t = _require_tensor(op, name, x)
        _check_dtype(op, name, t, (torch.float32,), _TRANSFORM_FIX)
        _check_shape(op, name, t, shape, what)
        _check_device(op, name, t, device, "k_pages")


def _check_first_tokens(
    op: str,
    first_k: object,
    first_v: object,
    first_lens: object,
    group_size: int | None,
    bsz: int,
    hkv: int,
    d: int,
    device: torch.device,
) -> None:
    """Structure of the first-token side buffer: all three or none, static scales."""
    given = (first_k is not None, first_v is not None, first_lens is not None)
    if not any(given):
        return
    if not all(given):
        missing = [
            n for n, g in zip(("first_k", "first_v", "first_lens"), given, strict=True) if not g
        ]
        raise _fail(
            f"{op}: {', '.join(missing)} is None but the other first-token arguments are "
            "given; expected first_k, first_v and first_lens together, or none of them. "
            "Fix: pass all three (first_lens zeros where a row has none), or none."
        )
    if group_size is not None:
        raise _fail(
            f"{op}: first-token buffers (first_k / first_v) were given with fp32 group "
            "scales; expected static k_scale and v_scale (the k-transform format). Fix: pass "
            "k_scale and v_scale, or drop first_k, first_v and first_lens."
        )
    fk = _require_tensor(op, "first_k", first_k)
    fv = _require_tensor(op, "first_v", first_v)
    layout = "[batch, n_first, num_kv_heads, head_dim]"
    _check_ndim(op, "first_k", fk, 4, layout)
    fix = "keep the first tokens' K (rotated frame) and V in the model dtype."
    _check_dtype(op, "first_k", fk, INPUT_DTYPES, fix)
    _check_dtype(op, "first_v", fv, INPUT_DTYPES, fix)
    nf = fk.shape[1]
    _check_shape(op, "first_k", fk, (bsz, nf, hkv, d), f"{layout} of the query and pages")
    _check_shape(op, "first_v", fv, (bsz, nf, hkv, d), f"{layout}, the shape of first_k")
    _check_device(op, "first_k", fk, device, "k_pages")
    _check_device(op, "first_v", fv, device, "k_pages")
    _check_index_vector(op, "first_lens", first_lens, bsz, device)


def _check_scales(
    op: str,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k_group_scales: torch.Tensor | None,
    v_group_scales: torch.Tensor | None,
    num_pages: int,
    page_size: int,
    hkv: int,
    d: int,
    device: torch.device,
    group_scales_written: bool,
) -> int | None:
    """Check that exactly one scale mode is given; return G for group scales, else None."""
    static = (k_scale is not None, v_scale is not None)
    group = (k_group_scales is not None, v_group_scales is not None)
    mode_fix = (
        "Fix: pass k_scale and v_scale (static per-tensor / per-head scales) or "
        "k_group_scales and v_group_scales (dynamic fp32-group scales), not a mix."
    )
    if any(static) and any(group):
        raise _fail(f"{op}: both static scales and group scales were given. {mode_fix}")
    if not any(static) and not any(group):
        raise _fail(f"{op}: no scales were given. {mode_fix}")
    if any(static):
        if not all(static):
            missing = "v_scale" if k_scale is not None else "k_scale"
            raise _fail(f"{op}: {missing} is None but its partner is given. {mode_fix}")
        _check_static_scale(op, "k_scale", _require_tensor(op, "k_scale", k_scale), hkv, device)
        _check_static_scale(op, "v_scale", _require_tensor(op, "v_scale", v_scale), hkv, device)
        return None
    if not all(group):
        missing = "v_group_scales" if k_group_scales is not None else "k_group_scales"
        raise _fail(f"{op}: {missing} is None but its partner is given. {mode_fix}")
    kg = _require_tensor(op, "k_group_scales", k_group_scales)
    vg = _require_tensor(op, "v_group_scales", v_group_scales)
    layout = "[num_pages, page_size, num_kv_heads, head_dim // group_size]"
    _check_ndim(op, "k_group_scales", kg, 4, layout)
    n_groups = kg.shape[-1]
    if n_groups < 1 or d % n_groups != 0:
        raise _fail(
            f"{op}: k_group_scales has {n_groups} groups per head in its last dim, which does "
            f"not divide head_dim {d}; expected head_dim // group_size with group_size dividing "
            f"{d}. Fix: choose a group_size that divides the head dim."
        )
    expected = (num_pages, page_size, hkv, n_groups)
    for name, g in (("k_group_scales", kg), ("v_group_scales", vg)):
        _check_dtype(
            op, name, g, (torch.float32,), "allocate fp32 group scales (PagedLayerStorage does)."
        )
        _check_shape(op, name, g, expected, f"{layout} of the pages")
        _check_device(op, name, g, device, "k_pages")
        if group_scales_written:
            _check_written_layout(
                op, name, g, helper="group_scale_storage", last_dim_contiguous=True
            )
    return d // n_groups


def _check_pages(
    op: str, k_pages: object, v_pages: object, *, written: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    kp = _require_tensor(op, "k_pages", k_pages)
    vp = _require_tensor(op, "v_pages", v_pages)
    layout = "[num_pages, page_size, num_kv_heads, head_dim]"
    _check_ndim(op, "k_pages", kp, 4, layout)
    page_fix = "allocate pages as torch.float8_e4m3fn (default) or torch.float8_e5m2."
    _check_dtype(op, "k_pages", kp, FP8_DTYPES, page_fix)
    _check_dtype(op, "v_pages", vp, FP8_DTYPES, page_fix)
    if vp.dtype != kp.dtype:
        raise _fail(
            f"{op}: v_pages has dtype {vp.dtype} but k_pages has {kp.dtype}; expected one FP8 "
            "format for both caches. Fix: allocate K and V pages with the same kv_dtype."
        )
    _check_shape(op, "v_pages", vp, tuple(kp.shape), "the shape of k_pages")
    _check_device(op, "v_pages", vp, kp.device, "k_pages")
    if written:
        for name, x in (("k_pages", kp), ("v_pages", vp)):
            _check_written_layout(op, name, x, helper="page_storage", last_dim_contiguous=False)
    return kp, vp


def _check_write_structure(
    key: object,
    value: object,
    k_pages: object,
    v_pages: object,
    slot_mapping: object,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k_group_scales: torch.Tensor | None,
    v_group_scales: torch.Tensor | None,
    k_offset: object = None,
    k_rotation: object = None,
) -> WriteGeometry:
    """Dtype, shape, device and stride checks of :func:`check_write_inputs`."""
    op = "write_kv"
    kp, _ = _check_pages(op, k_pages, v_pages, written=True)
    num_pages, page_size, hkv, d = kp.shape
    device = kp.device
    k = _require_tensor(op, "key", key)
    v = _require_tensor(op, "value", value)
    layout = "[batch, new_tokens, num_kv_heads, head_dim]"
    _check_ndim(op, "key", k, 4, layout)
    in_fix = "cast new K/V to float32, float16 or bfloat16."
    _check_dtype(op, "key", k, INPUT_DTYPES, in_fix)
    _check_dtype(op, "value", v, INPUT_DTYPES, in_fix)
    bsz, seq = k.shape[0], k.shape[1]
    _check_shape(op, "key", k, (bsz, seq, hkv, d), f"{layout} matching the pages' Hkv and D")
    _check_shape(op, "value", v, (bsz, seq, hkv, d), f"{layout}, the shape of key")
    _check_device(op, "key", k, device, "k_pages")
    _check_device(op, "value", v, device, "k_pages")
    sm = _require_tensor(op, "slot_mapping", slot_mapping)
    _check_dtype(
        op,
        "slot_mapping",
        sm,
        (torch.int64,),
        "build it with kvquant.cache.PageAllocator.reserve or kvquant.kernels.compute_slot_mapping.",
    )
    _check_shape(op, "slot_mapping", sm, (bsz, seq), "[batch, new_tokens] of key")
    _check_device(op, "slot_mapping", sm, device, "k_pages")
    group_size = _check_scales(
        op,
        k_scale,
        v_scale,
        k_group_scales,
        v_group_scales,
        num_pages,
        page_size,
        hkv,
        d,
        device,
        group_scales_written=True,
    )
    _check_k_transform(op, k_offset, k_rotation, group_size, hkv, d, device)
    written = [("k_pages", kp), ("v_pages", v_pages)]
    if k_group_scales is not None and v_group_scales is not None:
        written += [("k_group_scales", k_group_scales), ("v_group_scales", v_group_scales)]
    _check_disjoint(op, written)
    return WriteGeometry(bsz, seq, num_pages, page_size, hkv, d, group_size)


def _check_write_values(slot_mapping: torch.Tensor, geo: WriteGeometry) -> None:
    """Value check of :func:`check_write_inputs` (reads the slots: syncs a GPU)."""
    op = "write_kv"
    num_pages, page_size = geo.num_pages, geo.page_size
    top = int(slot_mapping.max())
    if top >= num_pages * page_size:
        raise _fail(
            f"{op}: slot_mapping holds slot {top}, but the cache has {num_pages} pages of "
            f"{page_size} slots ({num_pages * page_size} slots, 0..{num_pages * page_size - 1}); "
            "negative slots mean 'skip'. Fix: reserve slots with the cache's PageAllocator "
            "(slot = page * page_size + offset)."
        )


def _check_index_vector(
    op: str, name: str, x: object, bsz: int, device: torch.device
) -> torch.Tensor:
    t = _require_tensor(op, name, x)
    _check_dtype(op, name, t, (torch.int32,), f"build {name} with .to(torch.int32) once per step.")
    _check_shape(op, name, t, (bsz,), "one entry per sequence")
    _check_device(op, name, t, device, "k_pages")
    return t


def _check_attention_structure(
    query: object,
    k_pages: object,
    v_pages: object,
    block_tables: object,
    seq_lens: object,
    *,
    sm_scale: object,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k_group_scales: torch.Tensor | None,
    v_group_scales: torch.Tensor | None,
    q_lens: object,
    kv_start: object,
    causal: object,
    softcap: object,
    window: object,
    out: object,
    sinks: object = None,
    k_offset: object = None,
    k_rotation: object = None,
    first_k: object = None,
    first_v: object = None,
    first_lens: object = None,
) -> AttentionGeometry:
    """Dtype, shape, device, stride and option checks of :func:`check_attention_inputs`."""
    op = "paged_attention"
    kp, _ = _check_pages(op, k_pages, v_pages, written=False)
    num_pages, page_size, hkv, d = kp.shape
    device = kp.device
    q = _require_tensor(op, "query", query)
    layout = "[batch, q_len, num_heads, head_dim] (HF's [B, H, L, D] .transpose(1, 2) is fine)"
    _check_ndim(op, "query", q, 4, layout)
    _check_dtype(op, "query", q, INPUT_DTYPES, "cast the query to float16, bfloat16 or float32.")
    bsz, lq, hq, qd = q.shape
    if qd != d:
        raise _fail(
            f"{op}: query has head_dim {qd} but the pages have head_dim {d}. "
            "Fix: pass the cache built for this layer's geometry."
        )
    if hq == 0 or hq % hkv != 0:
        raise _fail(
            f"{op}: query has {hq} heads, not a positive multiple of the pages' {hkv} KV heads. "
            "Fix: pass the cache built for this model's num_key_value_heads."
        )
    _check_device(op, "query", q, device, "k_pages")
    bt = _require_tensor(op, "block_tables", block_tables)
    _check_ndim(op, "block_tables", bt, 2, "[batch, max_pages]")
    _check_dtype(
        op,
        "block_tables",
        bt,
        (torch.int32,),
        "use kvquant.cache.PageAllocator.block_tables (int32), or .to(torch.int32) once per step.",
    )
    if bt.shape[0] != bsz:
        raise _fail(
            f"{op}: block_tables has {bt.shape[0]} rows but query has batch {bsz}; expected "
            "one row per sequence. Fix: build block_tables for the same sequences as the query."
        )
    _check_device(op, "block_tables", bt, device, "k_pages")
    _check_index_vector(op, "seq_lens", seq_lens, bsz, device)
    if q_lens is not None:
        _check_index_vector(op, "q_lens", q_lens, bsz, device)
    if kv_start is not None:
        _check_index_vector(op, "kv_start", kv_start, bsz, device)
    group_size = _check_scales(
        op,
        k_scale,
        v_scale,
        k_group_scales,
        v_group_scales,
        num_pages,
        page_size,
        hkv,
        d,
        device,
        group_scales_written=False,
    )
    _check_k_transform(op, k_offset, k_rotation, group_size, hkv, d, device)
    _check_first_tokens(op, first_k, first_v, first_lens, group_size, bsz, hkv, d, device)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise _fail(
            f"{op}: sm_scale is a {type(sm_scale).__name__}; expected a Python float. "
            "Fix: pass sm_scale=head_dim ** -0.5 (or the model's scaling)."
        )
    if not math.isfinite(float(sm_scale)):
        raise _fail(
            f"{op}: sm_scale is {sm_scale}; expected a finite float. Fix: pass a finite scale."
        )
    if not isinstance(causal, bool):
        raise _fail(f"{op}: causal is a {type(causal).__name__}; expected a bool.")
    if (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not math.isfinite(softcap)
        or softcap < 0
    ):
        raise _fail(
            f"{op}: softcap is {softcap!r}; expected a finite float > 0, or 0 to disable it. "
            "Fix: pass the model's attn_logit_softcapping or 0.0."
        )
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise _fail(
            f"{op}: window is {window!r}; expected an int >= 0 (0 disables it). "
            "Fix: pass the model's sliding_window or 0."
        )
    if out is not None:
        o = _require_tensor(op, "out", out)
        _check_shape(op, "out", o, (bsz, lq, hq, d), "the query's shape")
        if o.dtype != q.dtype:
            raise _fail(
                f"{op}: out has dtype {o.dtype}; expected the query dtype {q.dtype}. "
                "Fix: allocate out like the query (torch.empty_like(query))."
            )
        _check_device(op, "out", o, device, "k_pages")
        if _overlaps(o):
            raise _fail(
                f"{op}: out is written in place but has strides {o.stride()} for shape "
                f"{tuple(o.shape)}, so that elements share memory (an expanded view?); "
                "expected no two elements sharing memory. Fix: allocate out with "
                "torch.empty_like(query) or torch.empty(query.shape)."
            )
    if sinks is not None:
        sk = _require_tensor(op, "sinks", sinks)
        _check_dtype(op, "sinks", sk, (torch.float32,), "pass module.sinks.float() (fp32).")
        _check_shape(op, "sinks", sk, (hq,), "one attention-sink logit per query head")
        _check_device(op, "sinks", sk, device, "k_pages")
        if hq > 1 and sk.stride(0) != 1:
            raise _fail(
                f"{op}: sinks has stride {sk.stride(0)}; expected a contiguous [{hq}] tensor. "
                "Fix: pass sinks.contiguous() once, when it is created."
            )
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
                raise _fail(
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
        raise _fail(
            f"{op}: seq_lens holds {min(lens)}..{max(lens)}; expected 0..{max_pages * page_size} "
            f"(block_tables has {max_pages} pages of {page_size} tokens per row). "
            "Fix: pass seq_lens and block_tables from the same PageAllocator step."
        )
    if not _page_ids_in_range(bt, lens, page_size, num_pages):
        _raise_page_id_error(op, bt, lens, page_size, num_pages)
    if ql is None:
        for b, n in enumerate(lens):
            if 0 < n < lq:
                raise _fail(
                    f"{op}: seq_lens[{b}] is {n} but the query has {lq} tokens and q_lens is "
                    "None (every query token needs its own key in the cache). Fix: pass "
                    "q_lens for ragged batches, or write the new tokens before attending."
                )
    else:
        qls = ql.tolist()
        for b, (nq, n) in enumerate(zip(qls, lens, strict=True)):
            if nq < 0 or nq > lq or nq > n:
                raise _fail(
                    f"{op}: q_lens[{b}] is {nq}; expected 0..min(q_len={lq}, seq_lens[{b}]={n}) "
                    "(the new queries' own keys are already in the cache). "
                    "Fix: write the new tokens before attending and pass their count."
                )
    if ks is not None:
        starts = ks.tolist()
        for b, (s0, n) in enumerate(zip(starts, lens, strict=True)):
            if s0 < 0 or s0 > n:
                raise _fail(
                    f"{op}: kv_start[{b}] is {s0}; expected 0..seq_lens[{b}]={n}. "
                    "Fix: pass the number of left-padding tokens of each sequence."
                )
    if first_lens is not None:
        starts = ks.tolist() if ks is not None else [0] * len(lens)
        for b, (nf, s0, n) in enumerate(zip(first_lens.tolist(), starts, lens, strict=True)):
            if nf < 0 or nf > n_first or s0 + nf > n:
                raise _fail(
                    f"{op}: first_lens[{b}] is {nf}; expected 0..min(n_first={n_first}, "
                    f"seq_lens[{b}] - kv_start[{b}] = {n - s0}) (first_k holds {n_first} "
                    "tokens per row, and only tokens in the cache can be first tokens). Fix: "
                    "count the first tokens stored for each row (0 where it has none)."
                )


# ------------------------------------------------------------ signature memo

_MEMO_MAX = 64
"""Signatures remembered per checker; a full memo is emptied."""

_STRIDED = torch.strided
_write_ok: dict[tuple[object, ...], WriteGeometry] = {}
_attention_ok: dict[tuple[object, ...], AttentionGeometry] = {}


def _signature(*args: object) -> tuple[object, ...] | None:
    """Everything the structural checks read from ``args``, as a hashable key.

    A tensor contributes its shape, strides, dtype and device (contiguity
    follows from shape and strides; :func:`check_write_inputs` adds the addresses
    of the tensors it writes); None stays None; a bool, int or float
    (a scalar option) contributes its type and value. Returns None ("do not
    remember") when an argument is anything else, or a tensor that is not
    strided (sparse, nested): such calls always run every check.
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


def _address(x: object) -> int | None:
    return x.data_ptr() if isinstance(x, torch.Tensor) else None


_G = TypeVar("_G")


def _remembered(
    memo: dict[tuple[object, ...], _G], sig: tuple[object, ...] | None, check: Callable[[], _G]
) -> _G:
    """``memo[sig]``, else ``check()`` (which raises on bad input), remembered when it passes."""
    geo = None if sig is None else memo.get(sig)
    if geo is None:
        geo = check()
        if sig is not None:
            if len(memo) >= _MEMO_MAX:
                memo.clear()
            memo[sig] = geo
    return geo


def clear_check_memo() -> None:
    """Forget every remembered signature: the next calls run every structural check."""
    _write_ok.clear()
    _attention_ok.clear()


def check_write_inputs(
    key: object,
    value: object,
    k_pages: object,
    v_pages: object,
    slot_mapping: object,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k_group_scales: torch.Tensor | None,
    v_group_scales: torch.Tensor | None,
    *,
    k_offset: torch.Tensor | None = None,
    k_rotation: torch.Tensor | None = None,
) -> WriteGeometry:
    """Validate the arguments of :func:`kvquant.kernels.write_kv`.

    The dtype, shape, device and stride checks read only tensor metadata;
    once they pass, their result is remembered under the signature of the
    arguments (every shape, stride, dtype and device), so a call with the same
    signature skips them and one that differs in anything they read runs them
    again. The value check (slots inside the cache, where values are cheap to
    read: see the module docstring) runs on every call.

    Args:
        key: ``[B, L, Hkv, D]`` fp32/fp16/bf16, any strides.
        value: ``[B, L, Hkv, D]`` fp32/fp16/bf16 (may differ from ``key``), any strides.
        k_pages: ``[num_pages, page_size, Hkv, D]`` FP8, no two elements sharing memory.
        v_pages: like ``k_pages``, same dtype.
        slot_mapping: int64 ``[B, L]``; negative = skip; otherwise below
            ``num_pages * page_size`` (checked where values are cheap to read,
            see the module docstring).
        k_scale: fp32 ``[]`` or ``[Hkv]``, with ``v_scale``.
        v_scale: fp32 ``[]`` or ``[Hkv]``.
        k_group_scales: fp32 ``[num_pages, page_size, Hkv, D // G]``, last dimension
            contiguous and no two elements sharing memory, with ``v_group_scales``.
        v_group_scales: like ``k_group_scales``.
        k_offset: fp32 ``[Hkv, D]`` finite, or None; needs static scales.
        k_rotation: fp32 ``[D, D]`` finite, or None; needs static scales.

    Returns:
        The call's sizes.

    Raises:
        KernelInputError: any argument is malformed.
    """
    sig = _signature(
        key,
        value,
        k_pages,
        v_pages,
        slot_mapping,
        k_scale,
        v_scale,
        k_group_scales,
        v_group_scales,
        k_offset,
        k_rotation,
    )
    if sig is not None:
        # where the written tensors live (they must not overlap): the cache's tensors stay put,
        # so a decode loop still hits the memo
        sig += tuple(_address(x) for x in (k_pages, v_pages, k_group_scales, v_group_scales))
    geo = _remembered(
        _write_ok,
        sig,
        lambda: _check_write_structure(
            key,
            value,
            k_pages,
            v_pages,
            slot_mapping,
            k_scale,
            v_scale,
            k_group_scales,
            v_group_scales,
            k_offset,
            k_rotation,
        ),
    )
    _check_transform_values("write_kv", k_offset, k_rotation)
    sm: torch.Tensor = slot_mapping  # type: ignore[assignment]  # checked above
    pages: torch.Tensor = k_pages  # type: ignore[assignment]
    if geo.group_size is None:
        check_scale_values("write_kv", "k_scale", k_scale)  # type: ignore[arg-type]
        check_scale_values("write_kv", "v_scale", v_scale)  # type: ignore[arg-type]
    if geo.batch and geo.seq and value_checks_enabled(pages.device):
        _check_write_values(sm, geo)
    return geo


def check_attention_inputs(
    query: object,
    k_pages: object,
    v_pages: object,
    block_tables: object,
    seq_lens: object,
    *,
    sm_scale: object,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k_group_scales: torch.Tensor | None,
    v_group_scales: torch.Tensor | None,
    q_lens: object,
    kv_start: object,
    causal: object,
    softcap: object,
    window: object,
    out: object,
    sinks: object = None,
    k_offset: object = None,
    k_rotation: object = None,
    first_k: object = None,
    first_v: object = None,
    first_lens: object = None,
) -> AttentionGeometry:
    """Validate the arguments of :func:`kvquant.kernels.paged_attention`.

    Dtype, shape, device, stride and option checks are remembered per
    signature of the arguments, like :func:`check_write_inputs` (options by
    type and value); the value checks (lengths and page ids inside the
    cache, where values are cheap to read) run on every call.

    Args:
        query: ``[B, Lq, Hq, D]`` fp32/fp16/bf16, any strides, ``Hq % Hkv == 0``.
        k_pages: ``[num_pages, page_size, Hkv, D]`` FP8, any strides.
        v_pages: like ``k_pages``, same dtype.
        block_tables: int32 ``[B, max_pages]``.
        seq_lens: int32 ``[B]``.
        sm_scale: softmax scale (a finite Python number).
        k_scale: fp32 ``[]`` or ``[Hkv]``, with ``v_scale``.
        v_scale: fp32 ``[]`` or ``[Hkv]``.
        k_group_scales: fp32 ``[num_pages, page_size, Hkv, D // G]``, with ``v_group_scales``.
        v_group_scales: like ``k_group_scales``.
        q_lens: int32 ``[B]`` or None.
        kv_start: int32 ``[B]`` or None.
        causal: bool.
        softcap: number >= 0.
        window: int >= 0.
        out: ``[B, Lq, Hq, D]`` in the query dtype, or None.
        sinks: fp32 ``[Hq]`` contiguous, finite, or None.
        k_offset: fp32 ``[Hkv, D]`` finite, or None; needs static scales.
        k_rotation: fp32 ``[D, D]`` finite, or None; needs static scales.
        first_k: ``[B, NF, Hkv, D]`` fp32/fp16/bf16, with ``first_v`` and ``first_lens``.
        first_v: like ``first_k``.
        first_lens: int32 ``[B]``, each in ``0..NF`` and at most ``seq_lens - kv_start``.

    Returns:
        The call's sizes.

    Raises:
        KernelInputError: any argument is malformed.
    """
    sig = _signature(
        query,
        k_pages,
        v_pages,
        block_tables,
        seq_lens,
        sm_scale,
        k_scale,
        v_scale,
        k_group_scales,
        v_group_scales,
        q_lens,
        kv_start,
        causal,
        softcap,
        window,
        out,
        sinks,
        k_offset,
        k_rotation,
        first_k,
        first_v,
        first_lens,
    )
    geo = _remembered(
        _attention_ok,
        sig,
        lambda: _check_attention_structure(
            query,
            k_pages,
            v_pages,
            block_tables,
            seq_lens,
            sm_scale=sm_scale,
            k_scale=k_scale,
            v_scale=v_scale,
            k_group_scales=k_group_scales,
            v_group_scales=v_group_scales,
            q_lens=q_lens,
            kv_start=kv_start,
            causal=causal,
            softcap=softcap,
            window=window,
            out=out,
            sinks=sinks,
            k_offset=k_offset,
            k_rotation=k_rotation,
            first_k=first_k,
            first_v=first_v,
            first_lens=first_lens,
        ),
    )
    _check_transform_values("paged_attention", k_offset, k_rotation)
    pages: torch.Tensor = k_pages  # type: ignore[assignment]  # checked above
    if geo.group_size is None:
        check_scale_values("paged_attention", "k_scale", k_scale)  # type: ignore[arg-type]
        check_scale_values("paged_attention", "v_scale", v_scale)  # type: ignore[arg-type]
    if sinks is not None:
        check_scale_values("paged_attention", "sinks", sinks, sinks=True)  # type: ignore[arg-type]
    if geo.batch and value_checks_enabled(pages.device):
        _check_attention_values(
            block_tables,  # type: ignore[arg-type]
            seq_lens,  # type: ignore[arg-type]
            q_lens,  # type: ignore[arg-type]
            kv_start,  # type: ignore[arg-type]
            geo,
            first_lens,  # type: ignore[arg-type]
            first_k.shape[1] if isinstance(first_k, torch.Tensor) else 0,
        )
    return geo


def _check_transform_values(op: str, k_offset: object, k_rotation: object) -> None:
    """Finite ``k_offset`` / ``k_rotation`` (structure already checked; values read once)."""
    for name, x in (("k_offset", k_offset), ("k_rotation", k_rotation)):
        if isinstance(x, torch.Tensor):
            check_finite_values(op, name, x, _TRANSFORM_FIX)


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
        raise _fail(
            f"{op}: page_size is {page_size!r}; expected an int >= 1 (the cache's token slots "
            "per page). Fix: pass the page size the block table was built with."
        )
    bt = _require_tensor(op, "block_tables", block_tables)
    _check_ndim(op, "block_tables", bt, 2, "[batch, max_pages]")
    _check_dtype(op, "block_tables", bt, (torch.int32, torch.int64), "pass an integer block table.")
    pos = _require_tensor(op, "positions", positions)
    _check_ndim(op, "positions", pos, 2, "[batch, new_tokens]")
    if pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
        raise _fail(
            f"{op}: positions has dtype {pos.dtype}; expected an integer dtype (token positions). "
            "Fix: build positions with torch.arange(..., dtype=torch.int64)."
        )
    if pos.shape[0] != bt.shape[0]:
        raise _fail(
            f"{op}: positions has {pos.shape[0]} rows but block_tables has {bt.shape[0]}; "
            "expected one row per sequence. Fix: pass positions of the same sequences."
        )
    _check_device(op, "positions", pos, bt.device, "block_tables")
    if pos.numel() and value_checks_enabled(bt.device):
        top = int(pos.max())
        if top >= bt.shape[1] * page_size:
            raise _fail(
                f"{op}: positions holds {top}, but block_tables lists {bt.shape[1]} pages of "
                f"{page_size} slots per sequence (positions 0..{bt.shape[1] * page_size - 1}; "
                "negative means padding). Fix: reserve the pages first, and pass the block table "
                "that lists them."
            )

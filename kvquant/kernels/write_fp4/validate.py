"""Argument checks of :func:`kvquant.kernels.write_fp4.write_fp4` (structure, then values).

Built on :mod:`kvquant.kernels.validate`'s helpers; everything here raises
:class:`~kvquant.errors.KernelInputError` before anything is written. Values (slots, global
scales) are read on CPU tensors, or everywhere with ``KVQUANT_CHECK_VALUES=1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvquant.kernels.fp4 import FP4_FORMATS, Fp4Format
from kvquant.kernels.validate import (
    SCALE_MAX,
    SCALE_MIN,
    check_device,
    check_disjoint,
    check_dtype,
    check_ndim,
    check_new_tokens,
    check_shape,
    fail,
    overlaps,
    require_tensor,
    value_checks_enabled,
)

__all__ = ["Fp4WriteGeometry", "check_write_fp4_inputs"]

OP = "write_fp4"
_ALLOC_FIX = "allocate pages and block scales with kvquant.kernels.fp4.fp4_page_storage"


@dataclass(frozen=True)
class Fp4WriteGeometry:
    """Sizes read from validated :func:`~kvquant.kernels.write_fp4.write_fp4` arguments."""

    batch: int
    seq: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int


def _check_written(name: str, x: torch.Tensor) -> None:
    if overlaps(x) or (x.shape[-1] > 1 and x.stride(-1) != 1):
        raise fail(
            f"{OP}: {name} is written in place but has strides {x.stride()} for shape "
            f"{tuple(x.shape)}; expected the last dimension contiguous and no two elements "
            f"sharing memory. Fix: {_ALLOC_FIX}."
        )


def _check_pages(fmt: Fp4Format, k_pages: object, v_pages: object) -> tuple[int, ...]:
    if not isinstance(fmt, Fp4Format) or fmt not in FP4_FORMATS:
        raise fail(
            f"{OP}: fmt is {fmt!r}; expected kvquant.kernels.fp4.NVFP4 or MXFP4. "
            "Fix: pass one of those two formats."
        )
    kp = require_tensor(OP, "k_pages", k_pages)
    vp = require_tensor(OP, "v_pages", v_pages)
    layout = "[num_pages, page_size, num_kv_heads, head_dim // 2]"
    check_ndim(OP, "k_pages", kp, 4, layout)
    for name, x in (("k_pages", kp), ("v_pages", vp)):
        check_dtype(OP, name, x, (torch.uint8,), f"{_ALLOC_FIX} (two e2m1 codes per byte).")
    check_shape(OP, "v_pages", vp, tuple(kp.shape), "the shape of k_pages")
    check_device(OP, "v_pages", vp, kp.device, "k_pages")
    d = 2 * kp.shape[3]
    if d % fmt.block_size:
        raise fail(
            f"{OP}: the pages hold head_dim {d}; expected a multiple of {fmt.name}'s block size "
            f"{fmt.block_size}. Fix: use a format whose block divides head_dim."
        )
    for name, x in (("k_pages", kp), ("v_pages", vp)):
        _check_written(name, x)
    return tuple(kp.shape)


def _check_block_scales(
    fmt: Fp4Format, shape: tuple[int, ...], device: torch.device, ks: object, vs: object
) -> list[tuple[str, torch.Tensor]]:
    num_pages, page_size, hkv, half = shape
    want = (num_pages, page_size, hkv, 2 * half // fmt.block_size)
    out = []
    for name, x in (("k_block_scales", ks), ("v_block_scales", vs)):
        t = require_tensor(OP, name, x)
        check_dtype(OP, name, t, (fmt.scale_dtype,), f"{_ALLOC_FIX} for {fmt.name}.")
        check_shape(OP, name, t, want, f"one {fmt.name} scale per block of {fmt.block_size}")
        check_device(OP, name, t, device, "k_pages")
        _check_written(name, t)
        out.append((name, t))
    return out


def _check_global_scales(
    fmt: Fp4Format, hkv: int, device: torch.device, kg: object, vg: object
) -> None:
    for name, g in (("k_global_scale", kg), ("v_global_scale", vg)):
        if not fmt.global_scale:
            if g is not None:
                raise fail(
                    f"{OP}: {name} was given for {fmt.name}, whose e8m0 block scales need none. "
                    "Fix: pass None (or use NVFP4)."
                )
            continue
        t = require_tensor(OP, name, g)
        fix = "normalise the checkpoint's global scale with kvquant.registry.fp4."
        check_dtype(OP, name, t, (torch.float32,), fix)
        if tuple(t.shape) not in ((), (hkv,)):
            raise fail(
                f"{OP}: {name} has shape {tuple(t.shape)}; expected () (per-tensor) or ({hkv},) "
                f"(per KV head). Fix: {fix}"
            )
        check_device(OP, name, t, device, "k_pages")
        if value_checks_enabled(device):
            flat = t.detach().reshape(-1)
            bad = ~(torch.isfinite(flat) & (flat >= SCALE_MIN) & (flat <= SCALE_MAX))
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise fail(
                    f"{OP}: {name} element {i} is {float(flat[i])!r}; expected a finite fp32 "
                    f"dequantization multiplier in [{SCALE_MIN:.3g}, {SCALE_MAX:.3g}] "
                    f"(amax / (6 * 448)). Fix: {fix}"
                )


def check_write_fp4_inputs(
    key: object,
    value: object,
    k_pages: object,
    v_pages: object,
    k_block_scales: object,
    v_block_scales: object,
    slot_mapping: object,
    fmt: Fp4Format,
    k_global_scale: object = None,
    v_global_scale: object = None,
) -> Fp4WriteGeometry:
    """Validate the arguments of :func:`~kvquant.kernels.write_fp4.write_fp4`.

    Returns:
        The call's sizes.

    Raises:
        KernelInputError: any argument is malformed.
    """
    shape = _check_pages(fmt, k_pages, v_pages)
    kp: torch.Tensor = k_pages  # type: ignore[assignment]  # checked above
    device = kp.device
    written = [("k_pages", kp), ("v_pages", v_pages)]
    written += _check_block_scales(fmt, shape, device, k_block_scales, v_block_scales)
    check_disjoint(OP, written)
    bsz, seq = check_new_tokens(OP, key, value, slot_mapping, (*shape[:3], 2 * shape[3]), device)
    _check_global_scales(fmt, shape[2], device, k_global_scale, v_global_scale)
    num_pages, page_size = shape[0], shape[1]
    sm: torch.Tensor = slot_mapping  # type: ignore[assignment]
    if sm.numel() and value_checks_enabled(device):
        top = int(sm.max())
        if top >= num_pages * page_size:
            raise fail(
                f"{OP}: slot_mapping holds slot {top}, but the cache has {num_pages} pages of "
                f"{page_size} slots (0..{num_pages * page_size - 1}); negative slots mean "
                "'skip'. Fix: reserve slots with kvquant.cache.PageAllocator."
            )
    return Fp4WriteGeometry(bsz, seq, num_pages, page_size, shape[2], 2 * shape[3])

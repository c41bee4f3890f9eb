"""Argument checks of :func:`kvquant.kernels.write_fp4.write_fp4` (structure, then slot values).

Built on :mod:`kvquant.kernels.validate`'s helpers (:func:`~kvquant.kernels.validate.
check_fp4_pages` for the pages, block scales and the scheme's scales against them); everything
here raises :class:`~kvquant.errors.KernelInputError` before anything is written. The scheme's
own values (global scales) were checked when it was built; slots are read on CPU tensors, or
everywhere with ``KVQUANT_CHECK_VALUES=1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvquant.kernels.validate import (
    address,
    check_disjoint,
    check_fp4_pages,
    check_new_tokens,
    fail,
    new_check_memo,
    remembered,
    signature,
    unpack,
    value_checks_enabled,
)
from kvquant.schemes import Fp4Scales, KernelView, Pages

__all__ = ["Fp4WriteGeometry", "check_write_fp4_inputs", "fp4_code"]

OP = "write_fp4"

_WRITE_FP4_OK: dict[tuple[object, ...], Fp4WriteGeometry] = new_check_memo("write_fp4")


@dataclass(frozen=True)
class Fp4WriteGeometry:
    """Sizes read from validated :func:`~kvquant.kernels.write_fp4.write_fp4` arguments."""

    batch: int
    seq: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int


def fp4_code(view: KernelView, side: str) -> int:
    """The kernels' code of a side's page format: 0 FP8, 1 NVFP4, 2 MXFP4."""
    fmt = view.k_fp4 if side == "k" else view.v_fp4
    return 0 if fmt is None else (1 if fmt.global_scale else 2)


def _check_structure(
    key: object, value: object, pages: Pages, slot_mapping: object, view: KernelView, d: int
) -> Fp4WriteGeometry:
    num_pages, page_size, hkv, _ = check_fp4_pages(OP, pages, view, d, written=True)
    device = pages.k.device
    bsz, seq = check_new_tokens(
        OP, key, value, slot_mapping, (num_pages, page_size, hkv, d), device
    )
    written = [("k_pages", pages.k), ("v_pages", pages.v)]
    written += [(f"{s}_block_scales", x) for s, x in (("k", pages.k_scales), ("v", pages.v_scales))
                if x is not None]  # fmt: skip
    check_disjoint(OP, written)
    return Fp4WriteGeometry(bsz, seq, num_pages, page_size, hkv, d)


def check_write_fp4_inputs(
    key: object, value: object, pages: object, slot_mapping: object, scheme: object
) -> Fp4WriteGeometry:
    """Validate the arguments of :func:`~kvquant.kernels.write_fp4.write_fp4`.

    The metadata checks are remembered per signature of the arguments (with the addresses of
    the written tensors), as :func:`kvquant.kernels.write.validate.check_write_inputs` does;
    the slot check runs on every call where values are cheap to read.

    Returns:
        The call's sizes.

    Raises:
        KernelInputError: any argument is malformed.
    """
    if not isinstance(scheme, Fp4Scales):
        raise fail(
            f"{OP}: scheme is {type(scheme).__name__} ({getattr(scheme, 'name', '?')!r}), which "
            "stores FP8 K and V; expected a 4-bit scheme (Nvfp4Scales, Mxfp4Scales, "
            "Fp8KNvfp4VScales). Fix: call kvquant.kernels.write_kv, which picks the write."
        )
    bundle, view = unpack(OP, pages, scheme)
    d = scheme.head_dim
    sig = signature(
        key, value, bundle.k, bundle.v, bundle.k_scales, bundle.v_scales, slot_mapping,
        view.k_scale, view.v_scale, d, fp4_code(view, "k"), fp4_code(view, "v"),
    )  # fmt: skip
    if sig is not None:
        sig += tuple(address(x) for x in (bundle.k, bundle.v, bundle.k_scales, bundle.v_scales))
    geo = remembered(
        _WRITE_FP4_OK, sig, lambda: _check_structure(key, value, bundle, slot_mapping, view, d)
    )
    sm: torch.Tensor = slot_mapping  # type: ignore[assignment]  # checked above
    if sm.numel() and value_checks_enabled(bundle.k.device):
        top = int(sm.max())
        slots = geo.num_pages * geo.page_size
        if top >= slots:
            raise fail(
                f"{OP}: slot_mapping holds slot {top}, but the cache has {geo.num_pages} pages "
                f"of {geo.page_size} slots (0..{slots - 1}); negative slots mean 'skip'. Fix: "
                "reserve slots with kvquant.cache.PageAllocator."
            )
    return geo

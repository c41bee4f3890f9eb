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
    signature,
    unpack,
    value_checks_enabled,
)
from kvquant.schemes import Fp4Scales, KernelView, Pages

__all__ = [
    "Fp4WriteGeometry",
    "check_write_fp4_inputs",
    "check_write_fp4_structure",
    "check_write_fp4_values",
    "fp4_code",
    "write_fp4_signature",
]

OP = "write_fp4"


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


def _refuse_fp8(scheme: object) -> None:
    if not isinstance(scheme, Fp4Scales):
        raise fail(
            f"{OP}: scheme is {type(scheme).__name__} ({getattr(scheme, 'name', '?')!r}), which "
            "stores FP8 K and V; expected a 4-bit scheme (Nvfp4Scales, Mxfp4Scales, "
            "Fp8KNvfp4VScales). Fix: call kvquant.kernels.write_kv, which picks the write."
        )


def write_fp4_signature(
    key: object, value: object, pages: object, slot_mapping: object, scheme: object
) -> tuple[object, ...] | None:
    """What :func:`check_write_fp4_structure` reads, with the written tensors' addresses.

    Raises:
        KernelInputError: ``pages`` or ``scheme`` is not one (or not a 4-bit scheme).
    """
    _refuse_fp8(scheme)
    bundle, view = unpack(OP, pages, scheme)
    d = scheme.head_dim  # type: ignore[attr-defined]  # checked above
    sig = signature(
        key, value, bundle.k, bundle.v, bundle.k_scales, bundle.v_scales, slot_mapping,
        view.k_scale, view.v_scale, view.k_offset, view.k_rotation, d, fp4_code(view, "k"),
        fp4_code(view, "v"),
    )  # fmt: skip
    if sig is None:
        return None
    return sig + tuple(address(x) for x in (bundle.k, bundle.v, bundle.k_scales, bundle.v_scales))


def check_write_fp4_structure(
    key: object, value: object, pages: object, slot_mapping: object, scheme: object
) -> Fp4WriteGeometry:
    """The metadata checks of :func:`check_write_fp4_inputs` (a plan runs them once).

    Raises:
        KernelInputError: any argument is malformed.
    """
    _refuse_fp8(scheme)
    bundle, view = unpack(OP, pages, scheme)
    return _check_structure(key, value, bundle, slot_mapping, view, scheme.head_dim)  # type: ignore[attr-defined]


def check_write_fp4_values(pages: Pages, slot_mapping: torch.Tensor, geo: Fp4WriteGeometry) -> None:
    """The slot check of :func:`check_write_fp4_inputs`, where values are cheap to read.

    Raises:
        KernelInputError: a slot beyond the cache.
    """
    sm = slot_mapping
    if sm.numel() and value_checks_enabled(pages.k.device):
        top = int(sm.max())
        slots = geo.num_pages * geo.page_size
        if top >= slots:
            raise fail(
                f"{OP}: slot_mapping holds slot {top}, but the cache has {geo.num_pages} pages "
                f"of {geo.page_size} slots (0..{slots - 1}); negative slots mean 'skip'. Fix: "
                "reserve slots with kvquant.cache.PageAllocator."
            )


def check_write_fp4_inputs(
    key: object, value: object, pages: object, slot_mapping: object, scheme: object
) -> Fp4WriteGeometry:
    """Validate the arguments of :func:`~kvquant.kernels.write_fp4.write_fp4` (every check).

    The metadata checks (:func:`check_write_fp4_structure`, run once per plan by
    :func:`kvquant.kernels.plan.plan_write`), then the slot check where values are cheap to
    read (:func:`check_write_fp4_values`, every run).

    Returns:
        The call's sizes.

    Raises:
        KernelInputError: any argument is malformed.
    """
    geo = check_write_fp4_structure(key, value, pages, slot_mapping, scheme)
    check_write_fp4_values(pages, slot_mapping, geo)  # type: ignore[arg-type]  # checked above
    return geo

"""Argument checks of :func:`kvquant.kernels.write_kv` (structure, then slot values).

Built on :mod:`kvquant.kernels.validate` (its helpers, scale checks and signatures):
everything here raises :class:`~kvquant.errors.KernelInputError` before anything is written.
The structural checks run when a plan is built (:func:`kvquant.kernels.plan.plan_write`),
the slot check on every run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvquant.kernels.validate import (
    address,
    check_disjoint,
    check_new_tokens,
    check_pages,
    check_scheme_tensors,
    fail,
    signature,
    unpack,
    value_checks_enabled,
)
from kvquant.schemes import KernelView, Pages

__all__ = [
    "WriteGeometry",
    "check_write_inputs",
    "check_write_structure",
    "check_write_values",
    "write_signature",
]


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


def _check_write_structure(
    key: object, value: object, pages: Pages, slot_mapping: object, view: KernelView
) -> WriteGeometry:
    """Dtype, shape, device and stride checks of :func:`check_write_inputs`."""
    op = "write_kv"
    kp, _ = check_pages(op, pages.k, pages.v, written=True)
    num_pages, page_size, hkv, d = kp.shape
    device = kp.device
    bsz, seq = check_new_tokens(op, key, value, slot_mapping, kp.shape, device)
    geometry = (num_pages, page_size, hkv, d)
    group_size = check_scheme_tensors(op, pages, view, geometry, device, group_scales_written=True)
    written = [("k_pages", kp), ("v_pages", pages.v)]
    if pages.k_scales is not None and pages.v_scales is not None:
        written += [("k_group_scales", pages.k_scales), ("v_group_scales", pages.v_scales)]
    check_disjoint(op, written)
    return WriteGeometry(bsz, seq, num_pages, page_size, hkv, d, group_size)


def _check_write_values(slot_mapping: torch.Tensor, geo: WriteGeometry) -> None:
    """Value check of :func:`check_write_inputs` (reads the slots: syncs a GPU)."""
    op = "write_kv"
    num_pages, page_size = geo.num_pages, geo.page_size
    top = int(slot_mapping.max())
    if top >= num_pages * page_size:
        raise fail(
            f"{op}: slot_mapping holds slot {top}, but the cache has {num_pages} pages of "
            f"{page_size} slots ({num_pages * page_size} slots, 0..{num_pages * page_size - 1}); "
            "negative slots mean 'skip'. Fix: reserve slots with the cache's PageAllocator "
            "(slot = page * page_size + offset)."
        )


def write_signature(
    key: object, value: object, pages: object, slot_mapping: object, scheme: object
) -> tuple[object, ...] | None:
    """Everything :func:`check_write_structure` reads, with the written tensors' addresses.

    The addresses count because the written tensors must not overlap: the cache's tensors
    stay put, so a decode loop keeps one plan per layer. None: no plan can be reused.

    Raises:
        KernelInputError: ``pages`` or ``scheme`` is not one.
    """
    bundle, view = unpack("write_kv", pages, scheme)
    sig = signature(
        key, value, bundle.k, bundle.v, slot_mapping, view.k_scale, view.v_scale,
        bundle.k_scales, bundle.v_scales, view.k_offset, view.k_rotation, view.group_size,
    )  # fmt: skip
    if sig is None:
        return None
    return sig + tuple(address(x) for x in (bundle.k, bundle.v, bundle.k_scales, bundle.v_scales))


def check_write_structure(
    key: object, value: object, pages: object, slot_mapping: object, scheme: object
) -> WriteGeometry:
    """Dtype, shape, device and stride checks of :func:`check_write_inputs` (metadata only).

    Raises:
        KernelInputError: any argument is malformed.
    """
    bundle, view = unpack("write_kv", pages, scheme)
    return _check_write_structure(key, value, bundle, slot_mapping, view)


def check_write_values(pages: Pages, slot_mapping: torch.Tensor, geo: WriteGeometry) -> None:
    """The slot check of :func:`check_write_inputs`, where values are cheap to read.

    Raises:
        KernelInputError: a slot beyond the cache.
    """
    if geo.batch and geo.seq and value_checks_enabled(pages.k.device):
        _check_write_values(slot_mapping, geo)


def check_write_inputs(
    key: object, value: object, pages: object, slot_mapping: object, scheme: object
) -> WriteGeometry:
    """Validate the arguments of :func:`kvquant.kernels.write_kv` (every check).

    :func:`check_write_structure` reads only tensor metadata (a plan,
    :func:`kvquant.kernels.plan.plan_write`, runs it once for the arguments'
    :func:`write_signature`); :func:`check_write_values` (slots inside the cache, where
    values are cheap to read: see :mod:`kvquant.kernels.validate`) runs on every call. The
    scheme's own values were checked when it was built.

    Args:
        key: ``[B, L, Hkv, D]`` fp32/fp16/bf16, any strides.
        value: ``[B, L, Hkv, D]`` fp32/fp16/bf16 (may differ from ``key``), any strides.
        pages: :class:`~kvquant.schemes.Pages`: FP8 ``[num_pages, page_size, Hkv, D]``, no
            two elements sharing memory; group scales (dynamic schemes only)
            ``[num_pages, page_size, Hkv, D // G]``, last dimension contiguous.
        slot_mapping: int64 ``[B, L]``; negative = skip; otherwise below
            ``num_pages * page_size``.
        scheme: a :class:`~kvquant.schemes.Scheme` for the pages' ``Hkv`` and ``D``.

    Returns:
        The call's sizes.

    Raises:
        KernelInputError: any argument is malformed.
    """
    geo = check_write_structure(key, value, pages, slot_mapping, scheme)
    check_write_values(pages, slot_mapping, geo)  # type: ignore[arg-type]  # checked above
    return geo

"""Argument checks of :func:`kvquant.kernels.write_kv` (structure, then slot values).

Built on :mod:`kvquant.kernels.validate` (its helpers, scale checks and signature memo):
everything here raises :class:`~kvquant.errors.KernelInputError` before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvquant.kernels.validate import (
    INPUT_DTYPES,
    address,
    check_device,
    check_disjoint,
    check_dtype,
    check_k_transform,
    check_ndim,
    check_pages,
    check_scale_values,
    check_scales,
    check_shape,
    check_transform_values,
    fail,
    new_check_memo,
    remembered,
    require_tensor,
    signature,
    value_checks_enabled,
)

__all__ = ["WriteGeometry", "check_write_inputs"]

_WRITE_OK: dict[tuple[object, ...], WriteGeometry] = new_check_memo("write")


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
    kp, _ = check_pages(op, k_pages, v_pages, written=True)
    num_pages, page_size, hkv, d = kp.shape
    device = kp.device
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
    check_device(op, "key", k, device, "k_pages")
    check_device(op, "value", v, device, "k_pages")
    sm = require_tensor(op, "slot_mapping", slot_mapping)
    check_dtype(
        op,
        "slot_mapping",
        sm,
        (torch.int64,),
        "build it with kvquant.cache.PageAllocator.reserve or kvquant.kernels.compute_slot_mapping.",
    )
    check_shape(op, "slot_mapping", sm, (bsz, seq), "[batch, new_tokens] of key")
    check_device(op, "slot_mapping", sm, device, "k_pages")
    group_size = check_scales(
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
    check_k_transform(op, k_offset, k_rotation, group_size, hkv, d, device)
    written = [("k_pages", kp), ("v_pages", v_pages)]
    if k_group_scales is not None and v_group_scales is not None:
        written += [("k_group_scales", k_group_scales), ("v_group_scales", v_group_scales)]
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
    sig = signature(
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
        sig += tuple(address(x) for x in (k_pages, v_pages, k_group_scales, v_group_scales))
    geo = remembered(
        _WRITE_OK,
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
    check_transform_values("write_kv", k_offset, k_rotation)
    sm: torch.Tensor = slot_mapping  # type: ignore[assignment]  # checked above
    pages: torch.Tensor = k_pages  # type: ignore[assignment]
    if geo.group_size is None:
        check_scale_values("write_kv", "k_scale", k_scale)  # type: ignore[arg-type]
        check_scale_values("write_kv", "v_scale", v_scale)  # type: ignore[arg-type]
    if geo.batch and geo.seq and value_checks_enabled(pages.device):
        _check_write_values(sm, geo)
    return geo

"""Pure-PyTorch reference of :func:`kvquant.kernels.write_kv` (the write's specification).

It is also the CPU backend (``backend="torch"``) and works on the kernels' paged layout
(:mod:`kvquant.kernels.attention.naive` describes it). No argument validation here.
"""

from __future__ import annotations

import torch

from kvquant.kernels.fp8 import fp8_max, quantize_fp8, transform_keys

__all__ = ["write_kv_reference"]


def _group_scales(x: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """fp32 group scales ``amax / fp8_max`` of ``x [..., D]`` → ``[..., D // group_size]``.

    An all-zero group gets scale 1.0 (any positive scale encodes zeros exactly);
    a group holding a non-finite value gets NaN.
    """
    xg = x.float().unflatten(-1, (-1, group_size))
    amax = xg.abs().amax(dim=-1)
    # Divide by a tensor, not a Python number: CUDA turns division by a CPU scalar into a
    # multiplication by its reciprocal, which rounds differently from the CPU (and the kernels).
    scale = amax / torch.full_like(amax, fp8_max(dtype))
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    finite = torch.isfinite(xg).all(dim=-1)
    return torch.where(finite, scale, torch.nan)


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_group_scales: torch.Tensor | None = None,
    v_group_scales: torch.Tensor | None = None,
    k_offset: torch.Tensor | None = None,
    k_rotation: torch.Tensor | None = None,
) -> None:
    """Quantize new K/V tokens and store them into their page slots (in place).

    With a K transform (``k_offset`` and/or ``k_rotation``, static scales only), K is
    stored as ``fp8((key @ R - c) / k_scale)``; V is stored as without it.

    Args:
        key: ``[B, L, Hkv, D]`` fp32, fp16 or bf16 (any strides).
        value: ``[B, L, Hkv, D]``, any float dtype (may differ from ``key``).
        k_pages: ``[num_pages, page_size, Hkv, D]`` FP8, written in place.
        v_pages: ``[num_pages, page_size, Hkv, D]`` FP8, written in place.
        slot_mapping: int64 ``[B, L]``; slot ``page * page_size + offset``; a
            negative slot means "do not store this token".
        k_scale: fp32 ``[]`` or ``[Hkv]`` static scale (with ``v_scale``).
        v_scale: fp32 ``[]`` or ``[Hkv]`` static scale.
        k_group_scales: fp32 ``[num_pages, page_size, Hkv, D // G]`` written in
            place (dynamic ``fp32-group`` format, with ``v_group_scales``).
        v_group_scales: like ``k_group_scales``.
        k_offset: fp32 ``[Hkv, D]`` K offset (rotated frame), or None (zeros).
        k_rotation: fp32 ``[D, D]`` orthonormal K rotation, or None (identity).
    """
    _, page_size, hkv, d = k_pages.shape
    slots = slot_mapping.reshape(-1)
    keep = slots >= 0
    slots = slots[keep]
    page, off = slots // page_size, slots % page_size
    transformed = k_offset is not None or k_rotation is not None
    for x, pages, static, groups in (
        (key, k_pages, k_scale, k_group_scales),
        (value, v_pages, v_scale, v_group_scales),
    ):
        xs = x.reshape(-1, hkv, d)[keep]
        if transformed and pages is k_pages:
            xs = transform_keys(xs, k_offset, k_rotation)
        if groups is not None:
            g = d // groups.shape[-1]
            sc = _group_scales(xs, g, pages.dtype)  # [N, Hkv, D/G]
            codes = quantize_fp8(xs, sc.repeat_interleave(g, dim=-1), pages.dtype)
            groups[page, off] = sc
        else:
            if static is None:
                raise ValueError("write_kv_reference needs static scales or group scales")
            sc = static.float().reshape(-1, 1) if static.dim() else static.float()
            codes = quantize_fp8(xs, sc, pages.dtype)
        pages[page, off] = codes

"""Pure-PyTorch reference of :func:`kvquant.kernels.write_fp4.write_fp4` (its specification).

Quantizes each written token of a 4-bit side with :func:`kvquant.kernels.fp4.quantize_fp4`
(an FP8 side with :func:`kvquant.kernels.fp8.quantize_fp8` and its static scale; K in the
k-transform's frame, FP8 or 4-bit, first rotated and offset,
:func:`kvquant.kernels.fp8.transform_keys`) and stores its codes and block scales at its slot;
negative slots are skipped. No argument validation.
"""

from __future__ import annotations

import torch

from kvquant.kernels.fp4 import quantize_fp4
from kvquant.kernels.fp8 import quantize_fp8, transform_keys
from kvquant.schemes import Pages, Scheme

__all__ = ["write_fp4_reference"]


def write_fp4_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    pages: Pages,
    slot_mapping: torch.Tensor,
    scheme: Scheme,
) -> None:
    """Quantize new K/V tokens and store them into their page slots (in place).

    Args:
        key: ``[B, L, Hkv, D]`` fp32, fp16 or bf16 (any strides).
        value: ``[B, L, Hkv, D]``, any float dtype.
        pages: per side, uint8 ``[num_pages, page_size, Hkv, D // 2]`` pages and their
            block scales (4-bit), or FP8 ``[num_pages, page_size, Hkv, D]`` pages (FP8 side),
            written in place.
        slot_mapping: int64 ``[B, L]``; slot ``page * page_size + offset``, negative = skip.
        scheme: a :class:`~kvquant.schemes.Fp4Scales`.
    """
    view = scheme.kernel_view()
    _, page_size, hkv = pages.k.shape[:3]
    slots = slot_mapping.reshape(-1)
    keep = slots >= 0
    slots = slots[keep]
    page, off = slots // page_size, slots % page_size
    for x, codes_out, scales_out, fmt, scale in (
        (key, pages.k, pages.k_scales, view.k_fp4, view.k_scale),
        (value, pages.v, pages.v_scales, view.v_fp4, view.v_scale),
    ):
        xs = x.reshape(x.shape[0] * x.shape[1], hkv, x.shape[-1])[keep]
        if codes_out is pages.k and (view.k_offset is not None or view.k_rotation is not None):
            xs = transform_keys(xs, view.k_offset, view.k_rotation)  # k @ R - c
        if fmt is None:
            s = scale.float().reshape(-1, 1) if scale.dim() else scale.float()  # type: ignore[union-attr]
            codes_out[page, off] = quantize_fp8(xs, s, codes_out.dtype)
            continue
        packed, codes = quantize_fp4(xs, fmt, scale)
        codes_out[page, off] = packed
        scales_out[page, off] = codes  # type: ignore[index]

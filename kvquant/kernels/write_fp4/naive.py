"""Pure-PyTorch reference of :func:`kvquant.kernels.write_fp4.write_fp4` (its specification).

Quantizes each written token with :func:`kvquant.kernels.fp4.quantize_fp4` and stores its packed
codes and block scales at its slot; negative slots are skipped. No argument validation here.
"""

from __future__ import annotations

import torch

from kvquant.kernels.fp4 import Fp4Format, quantize_fp4

__all__ = ["write_fp4_reference"]


def write_fp4_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k_block_scales: torch.Tensor,
    v_block_scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: Fp4Format,
    k_global_scale: torch.Tensor | None = None,
    v_global_scale: torch.Tensor | None = None,
) -> None:
    """Quantize new K/V tokens to 4-bit codes and store them into their page slots (in place).

    Args:
        key: ``[B, L, Hkv, D]`` fp32, fp16 or bf16 (any strides).
        value: ``[B, L, Hkv, D]``, any float dtype.
        k_pages: uint8 ``[num_pages, page_size, Hkv, D // 2]``, written in place.
        v_pages: like ``k_pages``.
        k_block_scales: ``fmt.scale_dtype`` ``[num_pages, page_size, Hkv, D // block]``.
        v_block_scales: like ``k_block_scales``.
        slot_mapping: int64 ``[B, L]``; slot ``page * page_size + offset``, negative = skip.
        fmt: :data:`~kvquant.kernels.fp4.NVFP4` or :data:`~kvquant.kernels.fp4.MXFP4`.
        k_global_scale: NVFP4's fp32 ``[]`` or ``[Hkv]``; None for MXFP4.
        v_global_scale: like ``k_global_scale``.
    """
    _, page_size, hkv, half = k_pages.shape
    slots = slot_mapping.reshape(-1)
    keep = slots >= 0
    slots = slots[keep]
    page, off = slots // page_size, slots % page_size
    for x, pages, scales, g in (
        (key, k_pages, k_block_scales, k_global_scale),
        (value, v_pages, v_block_scales, v_global_scale),
    ):
        packed, codes = quantize_fp4(x.reshape(-1, hkv, 2 * half)[keep], fmt, g)
        pages[page, off] = packed
        scales[page, off] = codes

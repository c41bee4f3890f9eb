"""``@triton.jit`` helper that reads a ``[BLOCK_N, D]`` tile of 4-bit K or V pages in registers.

:func:`load_fp4_tile` gathers the packed e2m1 bytes and block scales of ``BLOCK_N`` (token,
KV head) rows of NVFP4 or MXFP4 pages (:mod:`kvquant.kernels.fp4`'s layout, last dimensions
contiguous) and returns fp32 values, ``(e2m1 * block_scale) * g`` or ``e2m1 * 2^(E - 127)``;
masked rows read as zeros. The attention kernel's ``_load_kv`` calls it for a 4-bit side
(:mod:`kvquant.kernels.attention.tile`; docs/dev/fp4-formats.md, "How it is wired").
"""

import triton
import triton.language as tl

from kvquant.kernels.fp4_triton import e2m1_value, e4m3_value, e8m0_value

__all__ = ["load_fp4_tile"]


@triton.jit
def load_fp4_tile(
    pages_ptr,
    scales_ptr,
    row,
    scale_row,
    row_ok,
    g,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    NVFP4: tl.constexpr,
):
    """fp32 ``[BLOCK_N, D]`` values of 4-bit rows.

    Args:
        pages_ptr: uint8 pages ``[num_pages, page_size, Hkv, D // 2]``.
        scales_ptr: block scales ``[num_pages, page_size, Hkv, D // BLOCK]`` as uint8 codes.
        row: ``[BLOCK_N]`` element offsets of each row's first byte in the pages.
        scale_row: ``[BLOCK_N]`` element offsets of each row's first block scale.
        row_ok: ``[BLOCK_N]`` mask (other rows read as zeros).
        g: NVFP4's fp32 global scale of this KV head (ignored for MXFP4).
        D: head_dim.
        BLOCK: 16 (NVFP4) or 32 (MXFP4).
        NVFP4: e4m3 block scales times ``g``, else e8m0 exponents.
    """
    d = tl.arange(0, D)
    ok = row_ok[:, None]
    byte = tl.load(pages_ptr + row[:, None] + (d // 2)[None, :], mask=ok, other=0).to(tl.int32)
    code = tl.where((d % 2 == 0)[None, :], byte & 0xF, byte >> 4)
    sc = tl.load(scales_ptr + scale_row[:, None] + (d // BLOCK)[None, :], mask=ok, other=0)
    if NVFP4:
        v = (e2m1_value(code) * e4m3_value(sc.to(tl.int32))) * g
    else:
        v = e2m1_value(code) * e8m0_value(sc.to(tl.int32))
    return v

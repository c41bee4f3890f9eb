"""``@triton.jit`` helper that reads a ``[BLOCK_N, D]`` tile of 4-bit K or V pages in registers.

:func:`load_fp4_tile` gathers the packed e2m1 bytes and block scales of ``BLOCK_N`` (token,
KV head) rows of NVFP4 or MXFP4 pages (:mod:`kvquant.kernels.fp4`'s layout, last dimensions
contiguous) and returns fp32 values, ``(e2m1 * block_scale) * g`` or ``e2m1 * 2^(E - 127)``;
masked rows read as zeros. Each row's bytes are one contiguous load, each nibble becomes its
value by a bit placement (no per-element table or branch) and each block scale is decoded once. The attention kernel's ``_load_kv`` calls it for a 4-bit side
(:mod:`kvquant.kernels.attention.tile`; docs/dev/fp4-formats.md, "How it is wired").
"""

import triton
import triton.language as tl

from kvquant.kernels.fp4_triton import e4m3_value, e8m0_value

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
    n: tl.constexpr = row.shape[0]
    HALF: tl.constexpr = D // 2
    NB: tl.constexpr = D // BLOCK
    ok = row_ok[:, None]
    # one byte per element pair, loaded once: ``[BLOCK_N, D // 2]`` contiguous per row
    byte = tl.load(pages_ptr + row[:, None] + tl.arange(0, HALF)[None, :], mask=ok, other=0)
    byte = byte.to(tl.int32)
    # each nibble's e2m1 bits placed in an fp16 (sign to bit 15, exponent and mantissa to bits
    # 11..9) read as that fp16: the e2m1 value times 2^-14, exactly (code 1 is fp16's subnormal)
    lo = (((byte & 0x8) << 12) | ((byte & 0x7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (((byte & 0x80) << 8) | ((byte & 0x70) << 5)).to(tl.int16).to(tl.float16, bitcast=True)
    e2m1 = tl.reshape(tl.join(lo, hi), [n, NB, BLOCK]).to(tl.float32) * 16384.0
    # one block scale per block, decoded once
    sc = tl.load(scales_ptr + scale_row[:, None] + tl.arange(0, NB)[None, :], mask=ok, other=0)
    if NVFP4:
        v = (e2m1 * e4m3_value(sc.to(tl.int32))[:, :, None]) * g
    else:
        v = e2m1 * e8m0_value(sc.to(tl.int32))[:, :, None]
    return tl.reshape(v, [n, D])

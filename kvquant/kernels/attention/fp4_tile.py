"""``@triton.jit`` helper that reads a ``[BLOCK_N, D]`` tile of 4-bit K or V pages in registers.

:func:`load_fp4_tile` gathers the packed e2m1 codes and block scales of ``BLOCK_N`` (token,
KV head) rows of NVFP4 or MXFP4 pages (:mod:`kvquant.kernels.fp4`'s layout, last dimensions
contiguous) and returns fp16 values: ``e2m1 * block_scale * 2^-14`` for NVFP4 (its global
scale and the ``2^14`` are the caller's static multiplier), ``e2m1 * 2^(E - 127)`` for MXFP4;
masked rows read as zeros. Each row's codes are loaded as int32 words (eight codes each), two
codes of a word become one fp16 pair by a few 32-bit integer operations (no per-element table
or branch), and each block scale is decoded once, to fp16. The attention kernel's ``_load_kv``
calls it for a 4-bit side (:mod:`kvquant.kernels.attention.tile`; docs/dev/fp4-formats.md,
"How it is wired").
"""

import triton
import triton.language as tl

from kvquant.kernels.fp4_triton import e8m0_value

__all__ = ["load_fp4_tile"]


@triton.jit
def _pair(w, SHIFT: tl.constexpr):
    """The codes at bits ``SHIFT..SHIFT + 3`` and ``SHIFT + 16..SHIFT + 19`` of int32 words as
    fp16 bit patterns ``(low, high)``: the sign to bit 15, exponent and mantissa to bits 11..9
    (the e2m1 value times 2^-14, exactly; code 1 is fp16's subnormal 2^-15)."""
    if SHIFT == 12:
        x = (w & -0x7FFF8000) | ((w >> 3) & 0x0E000E00)  # -0x7FFF8000: the bits 0x80008000
    else:
        x = ((w << (12 - SHIFT)) & -0x7FFF8000) | ((w << (9 - SHIFT)) & 0x0E000E00)
    lo = x.to(tl.int16).to(tl.float16, bitcast=True)
    hi = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def load_fp4_tile(
    words_ptr,
    scales_ptr,
    row,
    scale_row,
    row_ok,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    NVFP4: tl.constexpr,
):
    """fp16 ``[BLOCK_N, D]`` values of 4-bit rows (NVFP4: times ``2^-14``, without ``g``).

    Args:
        words_ptr: the uint8 pages ``[num_pages, page_size, Hkv, D // 2]`` as an int32 pointer
            (offsets and strides of rows multiples of 4 bytes).
        scales_ptr: block scales ``[num_pages, page_size, Hkv, D // BLOCK]`` as uint8 codes.
        row: ``[BLOCK_N]`` offsets of each row's first word (int32 elements).
        scale_row: ``[BLOCK_N]`` element offsets of each row's first block scale.
        row_ok: ``[BLOCK_N]`` mask (other rows read as zeros).
        D: head_dim.
        BLOCK: 16 (NVFP4) or 32 (MXFP4).
        NVFP4: e4m3 block scales, else e8m0 exponents.
    """
    n: tl.constexpr = row.shape[0]
    NB: tl.constexpr = D // BLOCK
    WB: tl.constexpr = BLOCK // 8  # words per block
    ok = row_ok[:, None]
    # a row's D // 8 words, one contiguous load; word j holds elements 8j..8j+7, element
    # 8j + i in bits 4i..4i+3 (the low nibble of a byte is the even element)
    w = tl.load(words_ptr + row[:, None] + tl.arange(0, D // 8)[None, :], mask=ok, other=0)
    w = tl.reshape(w, [n, NB, WB])
    # p_i: elements (8j + i, 8j + i + 4) of every word j, [n, NB, WB, 2]; joined back into
    # element order 8j + 4h + 2a + b as [.., h, a, b]
    p0 = _pair(w, 0)
    p1 = _pair(w, 4)
    p2 = _pair(w, 8)
    p3 = _pair(w, 12)
    e2m1 = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # [n, NB, WB, 2, 2, 2]
    # one block scale per block, decoded once
    sc = tl.load(scales_ptr + scale_row[:, None] + tl.arange(0, NB)[None, :], mask=ok, other=0)
    if NVFP4:
        # e4m3 to fp16 is exact (the GPU converts two codes per instruction); the interpreter
        # reads the NaN codes 0x7F / 0xFF as +-480, hence the explicit NaN
        s = sc.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        s = tl.where((sc & 0x7F) == 0x7F, float("nan"), s)
        # exact in fp16: an e2m1 value (two significant bits, 0.5..6) times an e4m3 scale (four,
        # 2^-9..448) has at most six significant bits, its lowest bit at least 2^-10; times
        # 2^-14 it lies in [2^-24, 2688 * 2^-14], where fp16 (subnormals included) holds it
        v = e2m1 * s[:, :, None, None, None, None]
    else:
        # 2^(E - 127) in fp16, exponents above 15 clamped to 2^15 (such blocks overflow fp16
        # anyway; an infinite scale would turn zero codes into NaN); NaN stays NaN
        e = e8m0_value(sc.to(tl.int32))
        s = tl.where(e > 32768.0, 32768.0, e).to(tl.float16)
        v = (e2m1 * tl.full([1, 1, 1, 1, 1, 1], 16384.0, tl.float16)) * s[:, :, None, None, None, None]
    return tl.reshape(v, [n, D])

"""``@triton.jit`` helper that reads a ``[BLOCK_N, D]`` tile of 4-bit K or V pages in registers.

:func:`load_fp4_tile` gathers the packed e2m1 codes and block scales of ``BLOCK_N`` (token,
KV head) rows of NVFP4 or MXFP4 pages (:mod:`kvquant.kernels.fp4`'s layout, last dimensions
contiguous) and returns fp16 values divided by a constant power of two that the caller folds
into its static multiplier (64 for NVFP4, 16 for MXFP4), head_dim permuted within each four
elements; masked rows read as zeros. Each row's codes are loaded as int32 words (eight codes
each). On the GPU every code becomes an e4m3 byte by a few 32-bit integer operations on the
word (four codes per operation) and two bytes become an fp16 pair in one conversion
instruction, then one fp16x2 multiply applies the block scale (inline PTX, sm_89 and newer:
``PTX``); elsewhere (the interpreter runs no inline assembly) portable Triton computes the same
values.
Each block scale is decoded once, to fp16. The attention kernel's ``_load_kv`` calls it for a
4-bit side (:mod:`kvquant.kernels.attention.tile`; docs/dev/fp4-formats.md, "How it is wired").
"""

import triton
import triton.language as tl

from kvquant.kernels.fp4_triton import e4m3_value, e8m0_value

__all__ = ["load_fp4_tile"]

# Eight e2m1 codes of an int32 word (element 8j + i in bits 4i..4i+3 of word j: a byte's low
# nibble is the even element) times an fp16 block scale, as eight fp16 values in the order
# (0, 2, 1, 3, 4, 6, 5, 7). Each code becomes the e4m3 byte of e2m1 * 2^-6 (sign to bit 7,
# exponent and mantissa to bits 4..2; code 1 lands on e4m3's subnormal 2^-7): the high nibbles
# of the four bytes at once, then the low ones; cvt turns two e4m3 bytes into an fp16 pair.
_DECODE_PTX = tl.constexpr("""{
.reg .b32 t, lb, hb, s2, r0, r1, r2, r3;
.reg .b16 l0, l1, h0, h1;
shr.b32 t, $8, 2;
and.b32 t, t, 0x1C1C1C1C;
and.b32 hb, $8, 0x80808080;
or.b32 hb, hb, t;
shl.b32 t, $8, 2;
and.b32 t, t, 0x1C1C1C1C;
shl.b32 lb, $8, 4;
and.b32 lb, lb, 0x80808080;
or.b32 lb, lb, t;
mov.b32 {l0, l1}, lb;
mov.b32 {h0, h1}, hb;
cvt.rn.f16x2.e4m3x2 r0, l0;
cvt.rn.f16x2.e4m3x2 r1, h0;
cvt.rn.f16x2.e4m3x2 r2, l1;
cvt.rn.f16x2.e4m3x2 r3, h1;
mov.b32 s2, {$9, $9};
mul.rn.f16x2 r0, r0, s2;
mul.rn.f16x2 r1, r1, s2;
mul.rn.f16x2 r2, r2, s2;
mul.rn.f16x2 r3, r3, s2;
mov.b32 {$0, $1}, r0;
mov.b32 {$2, $3}, r1;
mov.b32 {$4, $5}, r2;
mov.b32 {$6, $7}, r3;
}""")


@triton.jit
def _code(w, ELEM: tl.constexpr, s):
    """Portable: element ``ELEM`` of int32 words times fp16 ``s``, as ``e2m1 * 2^-6 * s`` in fp16.

    The code's bits placed in an fp16 (sign to bit 15, exponent and mantissa to bits 11..9)
    read as ``e2m1 * 2^-14`` exactly; times 256 and ``s``, exactly (the caller's bounds)."""
    c = w >> (4 * ELEM)
    x = ((c & 8) << 12) | ((c & 7) << 9)
    return (x.to(tl.int16).to(tl.float16, bitcast=True) * 256.0) * s


@triton.jit
def _decode(w, s, PTX: tl.constexpr):
    """Eight fp16 ``e2m1 * 2^-6 * s`` per int32 word ``w``, elements (0, 2, 1, 3, 4, 6, 5, 7)."""
    if PTX:
        o = tl.inline_asm_elementwise(
            _DECODE_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, s], dtype=(tl.float16,) * 8,
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        o = (_code(w, 0, s), _code(w, 2, s), _code(w, 1, s), _code(w, 3, s),
             _code(w, 4, s), _code(w, 6, s), _code(w, 5, s), _code(w, 7, s))  # fmt: skip
    # column c of the word's eight is output c: the outermost join is the fastest dimension
    return tl.join(
        tl.join(tl.join(o[0], o[4]), tl.join(o[2], o[6])),
        tl.join(tl.join(o[1], o[5]), tl.join(o[3], o[7])),
    )


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
    PTX: tl.constexpr,
):
    """fp16 ``[BLOCK_N, D]`` values of 4-bit rows over 64 (NVFP4, without ``g``) or 16 (MXFP4),
    head_dim element ``4j + 2a + b`` at column ``4j + 2b + a``.

    Args:
        words_ptr: the uint8 pages ``[num_pages, page_size, Hkv, D // 2]`` as an int32 pointer
            (offsets and strides of rows multiples of 4 bytes).
        scales_ptr: block scales ``[num_pages, page_size, Hkv, D // BLOCK]`` as uint8 codes.
        row: ``[BLOCK_N]`` offsets of each row's first word (int32 elements).
        scale_row: ``[BLOCK_N]`` element offsets of each row's first block scale; for NVFP4
            multiples of ``D // BLOCK`` (as ``scales_ptr``'s address).
        row_ok: ``[BLOCK_N]`` mask (other rows read as zeros).
        D: head_dim.
        BLOCK: 16 (NVFP4) or 32 (MXFP4).
        NVFP4: e4m3 block scales, else e8m0 exponents.
        PTX: decode by inline PTX (CUDA, compute capability 8.9 and newer).
    """
    n: tl.constexpr = row.shape[0]
    NB: tl.constexpr = D // BLOCK
    WB: tl.constexpr = BLOCK // 8  # words per block
    ok = row_ok[:, None]
    # a row's D // 8 words, one contiguous load
    w = tl.load(words_ptr + row[:, None] + tl.arange(0, D // 8)[None, :], mask=ok, other=0)
    # one block scale per block, decoded once, to fp16
    # (NVFP4's rows at multiples of NB bytes from an address aligned alike: one vector load per
    # row; MXFP4's are left unhinted, as the kernel's base)
    if NVFP4:
        sc_row = tl.multiple_of(scale_row, NB)
    else:
        sc_row = scale_row
    sc = tl.load(scales_ptr + sc_row[:, None] + tl.arange(0, NB)[None, :], mask=ok, other=0)
    if NVFP4:
        # e4m3 to fp16 is exact: by the GPU's conversion with PTX, else from the code's bits
        # (no fp8 type: the interpreter reads the NaN codes as +-480, and GPUs before sm_89
        # have none). The products are exact in fp16: an e2m1 value (two significant bits,
        # 0.5..6) times an e4m3 scale (four, 2^-9..448) has at most six significant bits and
        # its lowest bit at least 2^-10; times 2^-6 it lies in [2^-16, 42]
        if PTX:
            s = sc.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:
            s = e4m3_value(sc.to(tl.int32)).to(tl.float16)
    else:
        # 2^(E - 125) in fp16: the products e2m1 * 2^(E - 127) * 2^-4 are exact for
        # E - 127 in [-19, 13] (fp16's subnormals included); above, the scale is clamped to
        # 2^15 (such blocks overflow fp16 anyway, and an infinite scale would turn zero codes
        # into NaN); NaN stays NaN
        e = e8m0_value(sc.to(tl.int32)) * 4.0
        s = tl.where(e > 32768.0, 32768.0, e).to(tl.float16)
    s = tl.broadcast_to(s[:, :, None], [n, NB, WB])
    v = _decode(tl.reshape(w, [n, NB, WB]), s, PTX)  # [n, NB, WB, 2, 2, 2]
    return tl.reshape(v, [n, D])

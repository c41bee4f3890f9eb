"""``@triton.jit`` twins of :mod:`kvquant.kernels.fp4`'s codes: e2m1 (encode), e4m3 and e8m0.

Every conversion uses integer and compare operations on the fp32 bits, never an fp8 cast (the
Triton 3.6 interpreter's fp32 -> fp8e4nv cast rounds about 2 % of values wrongly), so the write
kernel and the attention tiles agree bit for bit with the torch reference on CPU and GPU.
Users: :mod:`kvquant.kernels.write_fp4.kernel`, :mod:`kvquant.kernels.attention.fp4_tile`.
"""

import triton
import triton.language as tl

__all__ = ["e2m1_code", "e2m1_magnitude", "e4m3_code", "e4m3_value", "e8m0_value"]


@triton.jit
def e2m1_code(y):
    """e2m1 codes (int32, 0..15) of fp32 ``y``: nearest even, saturating; NaN -> 0, zero -> 0."""
    a = tl.abs(y)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    code += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    code += (a > 5.0).to(tl.int32)
    return tl.where((y < 0.0) & (code > 0), code | 8, code)


@triton.jit
def e2m1_magnitude(code):
    """fp32 magnitude of e2m1 codes (int32; the sign bit ignored): constants, never a product."""
    m = code & 7
    v = tl.where(m == 7, 6.0, tl.where(m == 6, 4.0, tl.where(m == 5, 3.0, 2.0)))
    v = tl.where(m == 3, 1.5, tl.where(m == 2, 1.0, tl.where(m == 1, 0.5, v)))
    return tl.where(m == 0, 0.0, v)


@triton.jit
def e4m3_code(t):
    """e4m3fn code (int32) of fp32 ``t`` in ``[0, 448]``: round to nearest even, subnormals kept."""
    bits = t.to(tl.int32, bitcast=True)
    q = bits >> 20  # exponent and the top three mantissa bits
    rem = bits & 0xFFFFF
    up = (rem > 0x80000) | ((rem == 0x80000) & ((q & 1) == 1))
    normal = q + up.to(tl.int32) - 960  # rebias the exponent: (127 - 7) << 3
    u = t * 512.0  # subnormals: multiples of 2^-9, exact
    f = u.to(tl.int32)
    frac = u - f.to(tl.float32)
    up_sub = (frac > 0.5) | ((frac == 0.5) & ((f & 1) == 1))
    return tl.where(t >= 0.015625, normal, f + up_sub.to(tl.int32))


@triton.jit
def e4m3_value(code):
    """fp32 value of non-negative e4m3fn codes (int32, 0..0x7F; ``0x7F`` is NaN)."""
    e = (code >> 3) & 15
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((code & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def e8m0_value(code):
    """fp32 ``2^(E - 127)`` of e8m0 codes (int32): ``255`` is NaN, ``0`` reads as 0."""
    v = (code << 23).to(tl.float32, bitcast=True)
    return tl.where(code == 255, float("nan"), v)

"""``@triton.jit`` kernel of the 4-bit cache write: quantize new K/V tokens into NVFP4/MXFP4 pages.

One launch writes K and V: each program takes ``BLOCK_T`` tokens and all their (head, block)
rows, loaded as the even and odd elements of each block (``[T, R, BLOCK // 2]`` each) so that a
pair packs into one byte without a reshape. ``K_FMT`` / ``V_FMT`` pick each side's format: 0
FP8 with a static scale (ModelOpt's FP8 K beside NVFP4 V), 1 NVFP4, 2 MXFP4. A 4-bit block
keeps the better of two block scales, compared by an exact integer sum of fixed-point errors.
Every code comes from integer and compare operations (:mod:`kvquant.kernels.fp4_triton`), never
an fp8 cast: bit for bit the reference :func:`~kvquant.kernels.write_fp4.naive.write_fp4_reference` on CPU
and GPU. Launcher: :mod:`kvquant.kernels.write_fp4.launch`; the codes: docs/dev/fp4-formats.md.
"""

import triton
import triton.language as tl

from kvquant.kernels.fp4_triton import e2m1_code, e2m1_magnitude, e4m3_code, e4m3_value

__all__ = ["write_fp4_kernel"]


@triton.jit
def _fp8_code(x, s):
    """e4m3fn byte (int32) of ``x / s``: nearest even, saturated at ±448; non-finite -> 0x7F."""
    y = tl.math.div_rn(x, s)
    code = e4m3_code(tl.minimum(tl.abs(y), 448.0))
    code = code | ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)  # the sign bit (-0.0 too)
    return tl.where(tl.abs(x) < float("inf"), code, 0x7F)


@triton.jit
def _candidate(xe, xo, denom):
    """e2m1 codes of the tiles under block scales ``denom [T, R]`` (0: zero codes) and each
    block's squared error in units of its scale: int64 sums of the errors' squares in fixed
    point (``min(| |y| - |e2m1(y)| |, 8)`` truncated to a multiple of ``2^-20``), exact in any
    summation order, so the choice is :func:`~kvquant.kernels.fp4.quantize_fp4`'s."""
    ok = denom[:, :, None] > 0.0
    safe = tl.where(denom > 0.0, denom, 1.0)[:, :, None]
    ye = tl.where(ok, tl.math.div_rn(xe, safe), 0.0)
    yo = tl.where(ok, tl.math.div_rn(xo, safe), 0.0)
    ce = e2m1_code(ye)
    co = e2m1_code(yo)
    re = tl.minimum(tl.abs(tl.abs(ye) - e2m1_magnitude(ce)), 8.0)
    ro = tl.minimum(tl.abs(tl.abs(yo) - e2m1_magnitude(co)), 8.0)
    fe = (re * 1048576.0).to(tl.int64)
    fo = (ro * 1048576.0).to(tl.int64)
    return ce, co, tl.sum(fe * fe, axis=2) + tl.sum(fo * fo, axis=2)


@triton.jit
def _second_is_better(err_a, m_a, p_a, err_b, m_b, p_b):
    """``err_b * b^2 < err_a * a^2`` for scales ``a = m_a * 2^p_a <= b = m_b * 2^p_b`` (int64)."""
    mb = m_b.to(tl.int64)
    ma = m_a.to(tl.int64)
    return ((err_b * mb * mb) << (2 * (p_b - p_a)).to(tl.int64)) < err_a * ma * ma


@triton.jit
def _e4m3_mantissa(code):
    """``M`` of e4m3 value ``M * 2^(p - 10)`` (int32 code)."""
    return tl.where((code >> 3) > 0, (code & 7) + 8, code & 7)


@triton.jit
def _quantize_store(
    xe, xo, pages_ptr, p_off, d_step, mask, scales_ptr, s_off, s_mask, g, FMT: tl.constexpr
):
    """Quantize one ``[T, R, BLOCK // 2]`` pair of tiles (even, odd elements) and store it.

    ``FMT`` 0: FP8 bytes at ``p_off`` (even) and ``p_off + d_step`` (odd), ``g`` the static
    scale; 1: NVFP4 (``g`` the global scale), 2: MXFP4, packed bytes at ``p_off``. A 4-bit
    block keeps the better of two scales (NVFP4: the maximum at e2m1's 6 or 4; MXFP4: the OCP
    exponent or the next), as :func:`~kvquant.kernels.fp4.quantize_fp4` does.
    """
    if FMT == 0:
        s = g[None, :, None]
        tl.store(pages_ptr + p_off, _fp8_code(xe, s).to(tl.uint8), mask=mask)
        tl.store(pages_ptr + p_off + d_step, _fp8_code(xo, s).to(tl.uint8), mask=mask)
    else:
        finite = (tl.abs(xe) < float("inf")) & (tl.abs(xo) < float("inf"))
        n_bad = tl.sum(tl.where(finite, 0, 1), axis=2)  # [T, R]
        ok = n_bad == 0
        xe = tl.where(ok[:, :, None], xe, 0.0)  # a non-finite block: zeros, NaN scale
        xo = tl.where(ok[:, :, None], xo, 0.0)
        amax = tl.maximum(tl.max(tl.abs(xe), axis=2), tl.max(tl.abs(xo), axis=2))
        if FMT == 1:
            code_a = e4m3_code(tl.minimum(tl.math.div_rn(amax, g[None, :] * 6.0), 448.0))
            code_b = e4m3_code(tl.minimum(tl.math.div_rn(amax, g[None, :] * 4.0), 448.0))
            denom_a = e4m3_value(code_a) * g[None, :]
            ce_a, co_a, err_a = _candidate(xe, xo, denom_a)
            ce_b, co_b, err_b = _candidate(xe, xo, e4m3_value(code_b) * g[None, :])
            p_a = tl.maximum(code_a >> 3, 1)
            p_b = tl.maximum(code_b >> 3, 1)
            m_a = _e4m3_mantissa(code_a)
            m_b = _e4m3_mantissa(code_b)
            take = _second_is_better(err_a, m_a, p_a, err_b, m_b, p_b)
            # a zero scale reconstructs zeros: the other is better once one of its codes is not 0
            nonzero_b = tl.max(ce_b | co_b, axis=2) > 0
            take = take | ((denom_a == 0.0) & nonzero_b)
            nan_code = 0x7F
        else:
            field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
            code_a = tl.minimum(tl.maximum(field - 2, 1), 254)
            code_b = tl.minimum(code_a + 1, 254)
            scale_a = (code_a << 23).to(tl.float32, bitcast=True)
            scale_b = (code_b << 23).to(tl.float32, bitcast=True)
            ce_a, co_a, err_a = _candidate(xe, xo, scale_a)
            ce_b, co_b, err_b = _candidate(xe, xo, scale_b)
            one = code_a * 0 + 1
            take = _second_is_better(err_a, one, code_a, err_b, one, code_b)
            nan_code = 255
        code = tl.where(ok, tl.where(take, code_b, code_a), nan_code)
        ce = tl.where(take[:, :, None], ce_b, ce_a)
        co = tl.where(take[:, :, None], co_b, co_a)
        byte = ce | (co << 4)
        byte = tl.where(ok[:, :, None], byte, 0)
        tl.store(pages_ptr + p_off, byte.to(tl.uint8), mask=mask)
        tl.store(scales_ptr + s_off, code.to(tl.uint8), mask=s_mask)


@triton.jit
def write_fp4_kernel(
    k_ptr, v_ptr, kp_ptr, vp_ptr, ks_ptr, vs_ptr, slot_ptr, kg_ptr, vg_ptr,
    n_tokens, seq_len, num_slots, page_size,
    sk_b, sk_l, sk_h, sk_d, sv_b, sv_l, sv_h, sv_d, ss_b, ss_l,
    skp_p, skp_t, skp_h, skp_d, svp_p, svp_t, svp_h, svp_d,
    sks_p, sks_t, sks_h, svs_p, svs_t, svs_h, skg_h, svg_h,
    HKV: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_NB: tl.constexpr, BLOCK_R: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = BLOCK // 2
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [T]
    t_ok = t < n_tokens
    b = t // seq_len
    pos = t % seq_len
    slot = tl.load(slot_ptr + b * ss_b + pos * ss_l, mask=t_ok, other=-1)
    t_ok = t_ok & (slot >= 0) & (slot < num_slots)
    pg = slot // page_size
    tk = slot % page_size

    r = tl.arange(0, BLOCK_R)  # (head, block) rows
    h = r // BLOCK_NB
    blk = r % BLOCK_NB
    r_ok = (h < HKV) & (blk < NB)
    j = tl.arange(0, HALF)
    d_even = (blk * BLOCK)[:, None] + 2 * j[None, :]  # [R, HALF]
    mask = t_ok[:, None, None] & r_ok[None, :, None]
    s_mask = t_ok[:, None] & r_ok[None, :]
    # the packed byte of each pair (4-bit), or the even element's byte (FP8: stride d)
    byte = (blk * HALF)[:, None] + j[None, :]
    k_col = d_even * skp_d if K_FMT == 0 else byte
    v_col = d_even * svp_d if V_FMT == 0 else byte

    kg = tl.zeros([BLOCK_R], tl.float32)
    vg = tl.zeros([BLOCK_R], tl.float32)
    if K_FMT != 2:  # FP8's static scale, NVFP4's global scale
        kg = tl.load(kg_ptr + h * skg_h, mask=r_ok, other=1.0).to(tl.float32)
    if V_FMT != 2:
        vg = tl.load(vg_ptr + h * svg_h, mask=r_ok, other=1.0).to(tl.float32)
    k_row = (b * sk_b + pos * sk_l)[:, None, None] + (h * sk_h)[None, :, None]
    v_row = (b * sv_b + pos * sv_l)[:, None, None] + (h * sv_h)[None, :, None]
    ke = tl.load(k_ptr + k_row + (d_even * sk_d)[None], mask=mask, other=0.0).to(tl.float32)
    ko = tl.load(k_ptr + k_row + ((d_even + 1) * sk_d)[None], mask=mask, other=0.0)
    ve = tl.load(v_ptr + v_row + (d_even * sv_d)[None], mask=mask, other=0.0).to(tl.float32)
    vo = tl.load(v_ptr + v_row + ((d_even + 1) * sv_d)[None], mask=mask, other=0.0)

    kp_off = (pg * skp_p + tk * skp_t)[:, None, None] + (h[:, None] * skp_h + k_col)[None]
    vp_off = (pg * svp_p + tk * svp_t)[:, None, None] + (h[:, None] * svp_h + v_col)[None]
    ks_off = (pg * sks_p + tk * sks_t)[:, None] + (h * sks_h + blk)[None, :]
    vs_off = (pg * svs_p + tk * svs_t)[:, None] + (h * svs_h + blk)[None, :]
    _quantize_store(ke, ko.to(tl.float32), kp_ptr, kp_off, skp_d, mask, ks_ptr, ks_off, s_mask,
                    kg, K_FMT)  # fmt: skip
    _quantize_store(ve, vo.to(tl.float32), vp_ptr, vp_off, svp_d, mask, vs_ptr, vs_off, s_mask,
                    vg, V_FMT)  # fmt: skip

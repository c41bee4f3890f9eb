"""``@triton.jit`` kernel of the 4-bit cache write: quantize new K/V tokens into NVFP4/MXFP4 pages.

One launch writes K and V: each program takes ``BLOCK_T`` tokens and all their (head, block)
rows, loaded as the even and odd elements of each block (``[T, R, BLOCK // 2]`` each) so that a
pair packs into one byte without a reshape. ``K_FMT`` / ``V_FMT`` pick each side's format: 0
FP8 with a static scale (ModelOpt's FP8 K beside NVFP4 V), 1 NVFP4, 2 MXFP4. Every code comes
from integer and compare operations (:mod:`kvquant.kernels.fp4_triton`), never an fp8 cast:
bit for bit the reference :func:`~kvquant.kernels.write_fp4.naive.write_fp4_reference` on CPU
and GPU. Launcher: :mod:`kvquant.kernels.write_fp4.launch`; the codes: docs/dev/fp4-formats.md.
"""

import triton
import triton.language as tl

from kvquant.kernels.fp4_triton import e2m1_code, e4m3_code, e4m3_value

__all__ = ["write_fp4_kernel"]


@triton.jit
def _fp8_code(x, s):
    """e4m3fn byte (int32) of ``x / s``: nearest even, saturated at ±448; non-finite -> 0x7F."""
    y = tl.math.div_rn(x, s)
    code = e4m3_code(tl.minimum(tl.abs(y), 448.0))
    code = code | ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)  # the sign bit (-0.0 too)
    return tl.where(tl.abs(x) < float("inf"), code, 0x7F)


@triton.jit
def _quantize_store(
    xe, xo, pages_ptr, p_off, d_step, mask, scales_ptr, s_off, s_mask, g, FMT: tl.constexpr
):
    """Quantize one ``[T, R, BLOCK // 2]`` pair of tiles (even, odd elements) and store it.

    ``FMT`` 0: FP8 bytes at ``p_off`` (even) and ``p_off + d_step`` (odd), ``g`` the static
    scale; 1: NVFP4 (``g`` the global scale), 2: MXFP4, packed bytes at ``p_off``.
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
            t = tl.minimum(tl.math.div_rn(amax, g[None, :] * 6.0), 448.0)
            code = e4m3_code(t)
            denom = e4m3_value(code) * g[None, :]
            safe = tl.where(denom > 0.0, denom, 1.0)[:, :, None]
            ye = tl.where(denom[:, :, None] > 0.0, tl.math.div_rn(xe, safe), 0.0)
            yo = tl.where(denom[:, :, None] > 0.0, tl.math.div_rn(xo, safe), 0.0)
            code = tl.where(ok, code, 0x7F)
        else:
            field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
            code = tl.minimum(tl.maximum(field - 2, 1), 254)
            scale = (code << 23).to(tl.float32, bitcast=True)[:, :, None]
            ye = tl.math.div_rn(xe, scale)
            yo = tl.math.div_rn(xo, scale)
            code = tl.where(ok, code, 255)
        byte = e2m1_code(ye) | (e2m1_code(yo) << 4)
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

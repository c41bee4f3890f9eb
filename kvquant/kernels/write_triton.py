"""Triton kernel that quantizes new K/V tokens into FP8 pages (the cache write).

One launch writes K and V together. Each program takes ``BLOCK_T`` tokens of
the flattened ``[B * L]`` batch and, for each token, all KV heads: the tile is
``[BLOCK_T, BLOCK_H * BLOCK_NG, BLOCK_G]`` (tokens x (head, group) rows x
elements of a group). With static scales there is one "group" per head
(``G = D``); with dynamic fp32-group scales the kernel computes
``amax / fp8_max`` per (token, head, group) from the tile and stores it beside
the page slot.

Semantics are those of :func:`kvquant.kernels.reference.write_kv_reference`,
bit for bit on a GPU: division is round-to-nearest (``div_rn``), values are
clamped to ``±fp8_max`` before the cast, an all-zero group gets scale 1.0, a
group with a non-finite value gets scale NaN, and non-finite inputs are
stored as NaN. Slots that are negative (skip) or beyond the cache
(``>= num_pages * page_size``) are not stored.

The static K transform (``k-transform``, static scales only) rotates each K tile by ``R``
(one ``tl.dot`` over the flattened ``[BLOCK_T * BLOCK_H, D]`` rows, fp32 inputs with
``input_precision="ieee"``, so that a GPU rounds like the fp32 reference up to summation
order) and subtracts the per-(head, channel) offset before the static-scale quantization;
a non-finite transformed value is stored as NaN. V is written as without it. Without a
transform the kernel compiles to the same code as before (``HAS_ROT``/``HAS_OFF`` are
``tl.constexpr``).

This module holds the kernel and its launcher only; arguments are validated
by :func:`kvquant.kernels.write_kv`.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from kvquant.kernels import specialize

__all__ = ["is_interpreted", "write_kv_triton"]


@triton.jit
def _transform_k(
    x,
    rot_ptr,
    off_ptr,
    h,
    d,
    rd_ok,
    s_r0,
    s_r1,
    s_o0,
    s_o1,
    HAS_ROT: tl.constexpr,
    HAS_OFF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
):
    """``x @ R - c`` of a static-scale K tile ``[T, R, G]`` (fp32; ``G >= D``, one group per head)."""
    if HAS_ROT:
        i = tl.arange(0, BLOCK_G)
        r_ok = (i < D)[:, None] & (i < D)[None, :]
        rot = tl.load(rot_ptr + i[:, None] * s_r0 + i[None, :] * s_r1, mask=r_ok, other=0.0)
        x2 = tl.reshape(x, [BLOCK_T * BLOCK_R, BLOCK_G])
        x2 = tl.dot(x2, rot.to(tl.float32), input_precision="ieee")
        x = tl.reshape(x2, [BLOCK_T, BLOCK_R, BLOCK_G])
    if HAS_OFF:
        c = tl.load(off_ptr + h[:, None] * s_o0 + d * s_o1, mask=rd_ok, other=0.0)  # [R, G]
        x = x - c[None, :, :]
    return x


@triton.jit
def _quantize_tile(
    x,
    pages_ptr,
    page_off,
    mask,
    scale_ptr,
    scale_off,
    scale_mask,
    group_ptr,
    group_off,
    group_mask,
    GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """Quantize one fp32 [T, R, G] tile of K or V and store it (and its group scales)."""
    finite = tl.abs(x) < float("inf")
    if GROUP:
        amax = tl.max(tl.abs(x), axis=2)  # [T, R]; NaN groups are overridden below
        n_bad = tl.sum(tl.where(finite, 0, 1), axis=2)
        scale = tl.where(amax > 0.0, tl.math.div_rn(amax, FP8_MAX), 1.0)
        scale = tl.where(n_bad == 0, scale, float("nan"))
        tl.store(group_ptr + group_off, scale, mask=group_mask)
        y = tl.math.div_rn(x, scale[:, :, None])
    else:
        s = tl.load(scale_ptr + scale_off, mask=scale_mask, other=1.0)  # [R]
        y = tl.math.div_rn(x, s[None, :, None])
    # Non-finite inputs (and NaN quotients) are stored as the NaN code 0x7F (NaN in e4m3fn
    # and e5m2), set on the bits rather than through the cast (the interpreter's cast of NaN
    # is wrong); finite values are clamped to ±FP8_MAX before the cast.
    ok = finite & (y == y)
    y = tl.where(ok, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX), 0.0)
    code = y.to(pages_ptr.dtype.element_ty).to(tl.uint8, bitcast=True)
    code = tl.where(ok, code, 0x7F).to(tl.uint8)
    tl.store(pages_ptr.to(tl.pointer_type(tl.uint8)) + page_off, code, mask=mask)


@specialize.jit(unaligned=("n_tokens", "seq_len", "num_slots", "ss_b"))
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kp_ptr,
    vp_ptr,
    slot_ptr,
    ks_ptr,
    vs_ptr,
    kg_ptr,
    vg_ptr,
    rot_ptr,
    off_ptr,
    n_tokens,
    seq_len,
    num_slots,
    sk_b,
    sk_l,
    sk_h,
    sk_d,
    sv_b,
    sv_l,
    sv_h,
    sv_d,
    ss_b,
    ss_l,
    sks_h,
    svs_h,
    page_size,
    skp_p,
    skp_t,
    skp_h,
    skp_d,
    svp_p,
    svp_t,
    svp_h,
    svp_d,
    skg_p,
    skg_t,
    skg_h,
    svg_p,
    svg_t,
    svg_h,
    s_r0,
    s_r1,
    s_o0,
    s_o1,
    HKV: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    NG: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_NG: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    HAS_ROT: tl.constexpr,
    HAS_OFF: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [T]
    t_ok = t < n_tokens
    b = t // seq_len
    pos = t % seq_len
    slot = tl.load(slot_ptr + b * ss_b + pos * ss_l, mask=t_ok, other=-1)  # int64 [T]
    t_ok = t_ok & (slot >= 0) & (slot < num_slots)

    r = tl.arange(0, BLOCK_R)  # (head, group) rows
    h = r // BLOCK_NG
    g = r % BLOCK_NG
    r_ok = (h < HKV) & (g < NG)
    e = tl.arange(0, BLOCK_G)
    d = g[:, None] * G + e[None, :]  # [R, G]
    rd_ok = r_ok[:, None] & (e < G)[None, :]
    mask = t_ok[:, None, None] & rd_ok[None, :, :]

    # pages and group scales: any strides (the cache stores V keys-fastest, scales head-major)
    pg = slot // page_size
    tk = slot % page_size
    kp_off = (pg * skp_p + tk * skp_t)[:, None, None] + (h[:, None] * skp_h + d * skp_d)[None, :, :]
    vp_off = (pg * svp_p + tk * svp_t)[:, None, None] + (h[:, None] * svp_h + d * svp_d)[None, :, :]
    kg_off = (pg * skg_p + tk * skg_t)[:, None] + (h * skg_h + g)[None, :]
    vg_off = (pg * svg_p + tk * svg_t)[:, None] + (h * svg_h + g)[None, :]
    group_mask = t_ok[:, None] & r_ok[None, :]

    k_row = (b * sk_b + pos * sk_l)[:, None, None] + (h[:, None] * sk_h)[None, :, :]
    if HAS_ROT and BLOCK_G > 128:
        # The whole fp32 R of a wide head does not fit in shared memory (256 x 256 x 4 bytes):
        # x @ R as a sum over 16-column slices of x (loaded from K) times 16-row slices of R.
        acc = tl.zeros([BLOCK_T * BLOCK_R, BLOCK_G], tl.float32)
        for j in tl.static_range(0, BLOCK_G // 16):
            i = j * 16 + tl.arange(0, 16)
            xs_ok = t_ok[:, None, None] & (r_ok[:, None] & (i < D)[None, :])[None, :, :]
            xs = tl.load(k_ptr + k_row + (i * sk_d)[None, None, :], mask=xs_ok, other=0.0)
            rs_ok = (i < D)[:, None] & (e < D)[None, :]
            rs = tl.load(rot_ptr + i[:, None] * s_r0 + e[None, :] * s_r1, mask=rs_ok, other=0.0)
            acc += tl.dot(
                tl.reshape(xs.to(tl.float32), [BLOCK_T * BLOCK_R, 16]),
                rs.to(tl.float32),
                input_precision="ieee",
            )
        k = tl.reshape(acc, [BLOCK_T, BLOCK_R, BLOCK_G])
        if HAS_OFF:
            k = _transform_k(k, rot_ptr, off_ptr, h, d, rd_ok, s_r0, s_r1, s_o0, s_o1,
                             False, HAS_OFF, BLOCK_T, BLOCK_R, BLOCK_G, D)  # fmt: skip
    else:
        k = tl.load(k_ptr + k_row + (d * sk_d)[None, :, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_ROT or HAS_OFF:
            k = _transform_k(k, rot_ptr, off_ptr, h, d, rd_ok, s_r0, s_r1, s_o0, s_o1,
                             HAS_ROT, HAS_OFF, BLOCK_T, BLOCK_R, BLOCK_G, D)  # fmt: skip
    _quantize_tile(
        k,
        kp_ptr,
        kp_off,
        mask,
        ks_ptr,
        h * sks_h,
        r_ok,
        kg_ptr,
        kg_off,
        group_mask,
        GROUP,
        FP8_MAX,
    )
    v_off = (b * sv_b + pos * sv_l)[:, None, None] + (h[:, None] * sv_h + d * sv_d)[None, :, :]
    _quantize_tile(
        tl.load(v_ptr + v_off, mask=mask, other=0.0).to(tl.float32),
        vp_ptr,
        vp_off,
        mask,
        vs_ptr,
        h * svs_h,
        r_ok,
        vg_ptr,
        vg_off,
        group_mask,
        GROUP,
        FP8_MAX,
    )


def is_interpreted() -> bool:
    """Whether this module's kernel runs in the Triton interpreter (``TRITON_INTERPRET=1``)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_write_kv_kernel, InterpretedFunction)


_FP8_MAX: dict[torch.dtype, float] = {
    dt: float(torch.finfo(dt).max) for dt in (torch.float8_e4m3fn, torch.float8_e5m2)
}


def _current_device() -> int:
    return torch.cuda.current_device()


@functools.lru_cache(maxsize=64)
def _blocks(hkv: int, g: int, ng: int, rotate: bool = False) -> tuple[int, int, int, int]:
    """``(BLOCK_NG, BLOCK_R, BLOCK_G, BLOCK_T)`` of the tile for ``hkv`` heads of ``ng`` groups of ``g``.

    With ``rotate`` the tile is one ``tl.dot`` operand: at least 16 rows and 16 columns.
    """
    block_ng = triton.next_power_of_2(ng)
    block_r = triton.next_power_of_2(hkv) * block_ng
    block_g = triton.next_power_of_2(g)
    if rotate:
        block_g = max(16, block_g)
    per_token = block_r * block_g
    block_t = max(1, min(16, 4096 // per_token))
    block_t = 1 << (block_t.bit_length() - 1)  # power of two
    if rotate:
        block_t = max(block_t, triton.cdiv(16, block_r))
    return block_ng, block_r, block_g, block_t


def _static_stride(s: torch.Tensor) -> int:
    return 0 if s.dim() == 0 else int(s.stride(0))


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k_group_scales: torch.Tensor | None,
    v_group_scales: torch.Tensor | None,
    k_offset: torch.Tensor | None = None,
    k_rotation: torch.Tensor | None = None,
) -> None:
    """Launch the fused K/V write (no validation: call :func:`kvquant.kernels.write_kv`).

    Args:
        key: ``[B, L, Hkv, D]`` fp32/fp16/bf16, any strides.
        value: ``[B, L, Hkv, D]`` fp32/fp16/bf16, any strides.
        k_pages: ``[num_pages, page_size, Hkv, D]`` FP8, any strides with no two elements
            sharing memory, written in place.
        v_pages: like ``k_pages``.
        slot_mapping: int64 ``[B, L]``, any strides.
        k_scale: fp32 ``[]`` or ``[Hkv]`` (static), or None with group scales.
        v_scale: fp32 ``[]`` or ``[Hkv]`` (static), or None with group scales.
        k_group_scales: fp32 ``[num_pages, page_size, Hkv, D // G]``, last dimension
            contiguous, no two elements sharing memory (any order of the other
            dimensions), or None.
        v_group_scales: like ``k_group_scales``.
        k_offset: fp32 ``[Hkv, D]`` K offset (static scales only), any strides, or None.
        k_rotation: fp32 ``[D, D]`` K rotation (static scales only), any strides, or None.
    """
    bsz, seq, hkv, d = key.shape
    n_tokens = bsz * seq
    if n_tokens == 0:
        return
    num_pages, page_size = k_pages.shape[0], k_pages.shape[1]
    group = k_group_scales is not None and v_group_scales is not None
    if k_group_scales is not None and v_group_scales is not None:
        ng = int(k_group_scales.shape[-1])
        g = d // ng
        ks_arg, vs_arg, sks, svs = k_pages, v_pages, 0, 0
        kg_arg, vg_arg = k_group_scales, v_group_scales
        kg_strides = k_group_scales.stride()[:3]
        vg_strides = v_group_scales.stride()[:3]
    elif k_scale is not None and v_scale is not None:
        ng, g = 1, d
        ks_arg, vs_arg = k_scale, v_scale
        sks, svs = _static_stride(k_scale), _static_stride(v_scale)
        kg_arg, vg_arg = k_pages, v_pages
        kg_strides = vg_strides = (0, 0, 0)
    else:
        raise ValueError("write_kv_triton needs k_scale/v_scale or k_group_scales/v_group_scales")
    rot_arg = k_rotation if k_rotation is not None else k_pages
    off_arg = k_offset if k_offset is not None else k_pages
    rot_strides = k_rotation.stride() if k_rotation is not None else (0, 0)
    off_strides = k_offset.stride() if k_offset is not None else (0, 0)
    block_ng, block_r, block_g, block_t = _blocks(hkv, g, ng, k_rotation is not None)
    grid = (triton.cdiv(n_tokens, block_t),)
    fp8_max = _FP8_MAX[k_pages.dtype]
    dev = key.device
    # Triton launches on the current CUDA device: switch only when the tensors are elsewhere.
    switch = dev.type == "cuda" and dev.index is not None and dev.index != _current_device()
    with torch.cuda.device(dev) if switch else contextlib.nullcontext():
        _write_kv_kernel[grid](
            key,
            value,
            k_pages,
            v_pages,
            slot_mapping,
            ks_arg,
            vs_arg,
            kg_arg,
            vg_arg,
            rot_arg,
            off_arg,
            n_tokens,
            seq,
            num_pages * page_size,
            *key.stride(),
            *value.stride(),
            *slot_mapping.stride(),
            sks,
            svs,
            page_size,
            *k_pages.stride(),
            *v_pages.stride(),
            *kg_strides,
            *vg_strides,
            *rot_strides,
            *off_strides,
            HKV=hkv,
            D=d,
            G=g,
            NG=ng,
            BLOCK_T=block_t,
            BLOCK_NG=block_ng,
            BLOCK_R=block_r,
            BLOCK_G=block_g,
            GROUP=group,
            FP8_MAX=fp8_max,
            HAS_ROT=k_rotation is not None,
            HAS_OFF=k_offset is not None,
            num_warps=4,
        )

"""``@triton.jit`` kernel of the cache write: quantize new K/V tokens into FP8 pages.

One launch writes K and V together: each program takes ``BLOCK_T`` tokens and all their KV
heads, a ``[BLOCK_T, BLOCK_H * BLOCK_NG, BLOCK_G]`` tile (tokens x (head, group) rows x
elements of a group; one group per head with static scales). Dynamic fp32-group scales are
computed from the tile (``amax / fp8_max``) and stored beside the slot; the static K
transform rotates K (one fp32 ``tl.dot``, ``input_precision="ieee"``) and subtracts the
offset first; fp32-group scales with a K rotation rotate whole heads (16-channel slices of K
times slices of R) before the groups' amax. With ``HAS_RING`` the tile is also stored at full
precision into the ring of each sequence's newest tokens (K after the rotation, before the
offset). Semantics, bit for bit on a GPU: :func:`kvquant.kernels.write_kv_reference`;
launcher: :mod:`kvquant.kernels.write.launch`; details: docs/dev/kernels.md.
"""

import triton
import triton.language as tl

from kvquant.kernels import specialize

__all__ = ["write_kv_kernel"]


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
def _rotated_heads(
    k_ptr,
    rot_ptr,
    b,
    pos,
    t_ok,
    sk_b,
    sk_l,
    sk_h,
    sk_d,
    s_r0,
    s_r1,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """``k @ R`` of the tile's whole heads, as the fp32 ``[T, R, G]`` tile of (head, group) rows.

    A sum over 16-column slices of K (loaded from K) times 16-row slices of R: the whole fp32 R
    of a wide head does not fit in shared memory (256 x 256 x 4 bytes), and group scales need
    every channel of a head rotated before any group's amax. Rows ``h * NG + g`` of the
    ``[T, H * NG, G]`` result are group ``g`` of head ``h`` (``BLOCK_NG * BLOCK_G == BLOCK_D``:
    a power-of-two ``D``, or one group per head).
    """
    hh = tl.arange(0, BLOCK_H)
    col = tl.arange(0, BLOCK_D)
    rows = (b * sk_b + pos * sk_l)[:, None, None] + (hh[:, None] * sk_h)[None, :, :]
    acc = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_D], tl.float32)
    for j in tl.static_range(0, BLOCK_D // 16):
        i = j * 16 + tl.arange(0, 16)
        xs_ok = t_ok[:, None, None] & ((hh < HKV)[:, None] & (i < D)[None, :])[None, :, :]
        xs = tl.load(k_ptr + rows + (i * sk_d)[None, None, :], mask=xs_ok, other=0.0)
        rs_ok = (i < D)[:, None] & (col < D)[None, :]
        rs = tl.load(rot_ptr + i[:, None] * s_r0 + col[None, :] * s_r1, mask=rs_ok, other=0.0)
        acc += tl.dot(
            tl.reshape(xs.to(tl.float32), [BLOCK_T * BLOCK_H, 16]),
            rs.to(tl.float32),
            input_precision="ieee",
        )
    return tl.reshape(acc, [BLOCK_T, BLOCK_R, BLOCK_G])


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
def write_kv_kernel(
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
    ring_ptr,
    rstart_ptr,
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
    ring_len,
    sr_b,
    sr_kv,
    sr_s,
    sr_h,
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
    HAS_RING: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [T]
    tok_ok = t < n_tokens
    b = t // seq_len
    pos = t % seq_len
    slot = tl.load(slot_ptr + b * ss_b + pos * ss_l, mask=tok_ok, other=-1)  # int64 [T]
    t_ok = tok_ok & (slot >= 0) & (slot < num_slots)
    if HAS_RING:  # the ring takes every token, whatever its slot
        load_ok = tok_ok
    else:
        load_ok = t_ok

    r = tl.arange(0, BLOCK_R)  # (head, group) rows
    h = r // BLOCK_NG
    g = r % BLOCK_NG
    r_ok = (h < HKV) & (g < NG)
    e = tl.arange(0, BLOCK_G)
    d = g[:, None] * G + e[None, :]  # [R, G]
    rd_ok = r_ok[:, None] & (e < G)[None, :]
    mask = t_ok[:, None, None] & rd_ok[None, :, :]
    lmask = load_ok[:, None, None] & rd_ok[None, :, :]

    # pages and group scales: any strides (the cache stores V keys-fastest, scales head-major)
    pg = slot // page_size
    tk = slot % page_size
    kp_off = (pg * skp_p + tk * skp_t)[:, None, None] + (h[:, None] * skp_h + d * skp_d)[None, :, :]
    vp_off = (pg * svp_p + tk * svp_t)[:, None, None] + (h[:, None] * svp_h + d * svp_d)[None, :, :]
    kg_off = (pg * skg_p + tk * skg_t)[:, None] + (h * skg_h + g)[None, :]
    vg_off = (pg * svg_p + tk * svg_t)[:, None] + (h * svg_h + g)[None, :]
    group_mask = t_ok[:, None] & r_ok[None, :]

    if HAS_RING:  # slot (start + l) % R of the sequence's ring; contiguous head dim
        r_slot = (tl.load(rstart_ptr) + pos) % ring_len
        r_off = (b * sr_b + r_slot * sr_s)[:, None, None] + (h[:, None] * sr_h + d)[None, :, :]
    k_row = (b * sk_b + pos * sk_l)[:, None, None] + (h[:, None] * sk_h)[None, :, :]
    if HAS_ROT and (GROUP or BLOCK_G > 128):
        k = _rotated_heads(k_ptr, rot_ptr, b, pos, load_ok, sk_b, sk_l, sk_h, sk_d, s_r0, s_r1,
                           HKV, D, BLOCK_T, BLOCK_R // BLOCK_NG, BLOCK_NG * BLOCK_G, BLOCK_R,
                           BLOCK_G)  # fmt: skip
    else:
        k = tl.load(k_ptr + k_row + (d * sk_d)[None, :, :], mask=lmask, other=0.0).to(tl.float32)
        if HAS_ROT:
            k = _transform_k(k, rot_ptr, off_ptr, h, d, rd_ok, s_r0, s_r1, s_o0, s_o1,
                             HAS_ROT, False, BLOCK_T, BLOCK_R, BLOCK_G, D)  # fmt: skip
    if HAS_RING:
        tl.store(ring_ptr + r_off, k.to(ring_ptr.dtype.element_ty), mask=lmask)
    if HAS_OFF:
        k = _transform_k(k, rot_ptr, off_ptr, h, d, rd_ok, s_r0, s_r1, s_o0, s_o1,
                         False, HAS_OFF, BLOCK_T, BLOCK_R, BLOCK_G, D)  # fmt: skip
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
    v = tl.load(v_ptr + v_off, mask=lmask, other=0.0)
    if HAS_RING:
        tl.store(ring_ptr + sr_kv + r_off, v.to(ring_ptr.dtype.element_ty), mask=lmask)
    _quantize_tile(
        v.to(tl.float32),
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

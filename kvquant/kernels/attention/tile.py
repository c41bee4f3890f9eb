"""``@triton.jit`` tile helpers of the paged-attention kernel: gather, dequantize, one step.

:func:`attn_tile` is one online-softmax step over ``BLOCK_N`` keys: :func:`_load_kv`
gathers the FP8 K/V tiles (runs of ``TP`` keys inside one page) and their group scales (a
4-bit side: its codes and block scales, dequantized in registers by ``load_fp4_tile``),
:func:`_qk` and :func:`_pv` are the two tensor-core products with the scales folded or
dequantized. The design (run loads, folding, masks) is described in docs/dev/kernels.md.
"""

import triton
import triton.language as tl

from kvquant.kernels.attention.fp4_tile import load_fp4_tile

__all__ = ["attn_tile"]


@triton.jit
def _load(ptrs, mask, other, MASKED: tl.constexpr):
    """``tl.load(ptrs)``; with ``MASKED``, masked-out elements read as ``other``."""
    if MASKED:
        x = tl.load(ptrs, mask=mask, other=other)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _load_kv(
    n0,
    lo,
    limit,
    bt_row,
    k_base,
    v_base,
    kg_base,
    vg_base,
    s_k,
    s_v,
    s_kg,
    s_vg,
    kb_base,
    vb_base,
    s_kb,
    s_vb,
    MASKED: tl.constexpr,
    GROUP_SCALES: tl.constexpr,
    FOLD: tl.constexpr,
    NG: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_D: tl.constexpr,
    PAGE: tl.constexpr,
    TP: tl.constexpr,
    V_RUNS_DENSE: tl.constexpr,
    SCALE_RUNS_DENSE: tl.constexpr,
    K_FP4: tl.constexpr,
    V_FP4: tl.constexpr,
):
    """Gather the raw FP8 tiles ``[BLOCK_N, D]`` of keys ``n0 + i`` and their group scales.

    ``n0`` is a multiple of ``TP``, which divides ``PAGE``: the tile is ``BLOCK_N // TP``
    runs of ``TP`` keys, each inside one page, so each run takes one block-table entry, and
    a stride-1 axis (head dim, or keys for V stored keys-fastest) gives wide copies. Masked
    tiles load only keys in ``[lo, limit)``. Returns ``(k, v, ks, vs)``. With dequantized
    group scales ``v`` is transposed, ``[D, BLOCK_N]``, and ``ks`` is ``[BLOCK_N, NG]``; the
    other group scales are ``[NG, BLOCK_N]``; without group scales they are placeholders.
    A 4-bit side (``K_FP4`` / ``V_FP4``: 1 NVFP4, 2 MXFP4, plus 4 to decode by inline PTX) is
    gathered key by key from its packed pages and block scales and returned dequantized in fp16
    over a constant (:func:`load_fp4_tile`: its values over 64, NVFP4 without its global scale,
    or over 16, MXFP4; head_dim permuted within fours), ``[BLOCK_N, D]``.
    """
    # strides: K/V (page, slot, head, dim), group scales (page, slot, head)
    s_kp, s_kt, s_kd = s_k[0], s_k[1], s_k[3]
    s_vp, s_vt, s_vd = s_v[0], s_v[1], s_v[3]
    s_kgp, s_kgt, s_vgp, s_vgt = s_kg[0], s_kg[1], s_vg[0], s_vg[1]
    NP: tl.constexpr = BLOCK_N // TP
    K_BLOCK: tl.constexpr = 16 if K_FP4 % 4 == 1 else 32  # NVFP4's, MXFP4's block size
    V_BLOCK: tl.constexpr = 16 if V_FP4 % 4 == 1 else 32
    offs_d = tl.arange(0, HEAD_D)
    offs_t = tl.arange(0, TP)
    run = n0 + tl.arange(0, NP) * TP  # first key of each run [NP]
    key = run[:, None] + offs_t[None, :]  # [NP, TP]
    key_ok = (key >= lo) & (key < limit)
    run_ok = (run + TP > lo) & (run < limit)  # the run holds a key to load: its page exists
    page = _load(bt_row + run // PAGE, run_ok, 0, MASKED).to(tl.int64)
    tok = tl.multiple_of(run % PAGE, TP)  # runs start at multiples of TP (wide, aligned copies)
    # [NP, TP, D]: the run's base, then the key within the run, then the head dim
    k_off = (page * s_kp + tok * s_kt)[:, None, None] + (offs_t * s_kt)[None, :, None]
    k_ptrs = k_base + k_off + (offs_d * s_kd)[None, None, :]
    # Masked tiles load whole runs (a mask constant along both axes keeps the copies wide);
    # the scores of keys outside [lo, limit) are masked later, and their V rows are zeroed by
    # the caller, since stale slots may hold NaN codes and 0 * NaN would reach the output.
    if K_FP4 != 0:
        key_page = tl.reshape(tl.broadcast_to(page[:, None], [NP, TP]), [BLOCK_N])
        key_tok = tl.reshape(tok[:, None] + offs_t[None, :], [BLOCK_N])
        key_run_ok = tl.reshape(tl.broadcast_to(run_ok[:, None], [NP, TP]), [BLOCK_N])
        # int32 words: the launcher keeps the 4-bit pages' strides and offsets multiples of 4
        k = load_fp4_tile(
            k_base.to(tl.pointer_type(tl.int32)), kb_base,
            key_page * (s_kp // 4) + key_tok * (s_kt // 4),
            key_page * s_kb[0] + key_tok * s_kb[1], key_run_ok, HEAD_D, K_BLOCK, K_FP4 % 4 == 1,
            K_FP4 >= 4,
        )  # fmt: skip
    else:
        k = tl.reshape(_load(k_ptrs, run_ok[:, None, None], 0.0, MASKED), [BLOCK_N, HEAD_D])
    if GROUP_SCALES and not FOLD:
        # dequantized tiles: V transposed, [D, BLOCK_N], gathered as [NP, D, TP], so that the
        # fp16 operand of P @ V keeps keys contiguous in shared memory (K-major)
        if V_RUNS_DENSE:
            # each run's [D, TP] block is one contiguous span (V keys-fastest, TP = PAGE):
            # loaded as [NP, D * TP], so that a warp's copies are contiguous both in global
            # memory and in the shared-memory staging buffer (no bank conflicts)
            offs_j = tl.arange(0, HEAD_D * TP)
            v_ptrs = v_base + (page * s_vp + tok)[:, None] + offs_j[None, :]
            v = tl.reshape(_load(v_ptrs, run_ok[:, None], 0.0, MASKED), [NP, HEAD_D, TP])
        else:
            v_off = (page * s_vp + tok * s_vt)[:, None, None] + (offs_t * s_vt)[None, None, :]
            v = _load(v_base + v_off + (offs_d * s_vd)[None, :, None], run_ok[:, None, None],
                      0.0, MASKED)  # fmt: skip
        v = tl.reshape(tl.permute(v, (1, 0, 2)), [HEAD_D, BLOCK_N])
    elif V_FP4 != 0:
        key_page = tl.reshape(tl.broadcast_to(page[:, None], [NP, TP]), [BLOCK_N])
        key_tok = tl.reshape(tok[:, None] + offs_t[None, :], [BLOCK_N])
        key_run_ok = tl.reshape(tl.broadcast_to(run_ok[:, None], [NP, TP]), [BLOCK_N])
        v = load_fp4_tile(
            v_base.to(tl.pointer_type(tl.int32)), vb_base,
            key_page * (s_vp // 4) + key_tok * (s_vt // 4),
            key_page * s_vb[0] + key_tok * s_vb[1], key_run_ok, HEAD_D, V_BLOCK, V_FP4 % 4 == 1,
            V_FP4 >= 4,
        )  # fmt: skip
    else:
        v_off = (page * s_vp + tok * s_vt)[:, None, None] + (offs_t * s_vt)[None, :, None]
        v_ptrs = v_base + v_off + (offs_d * s_vd)[None, None, :]
        v = tl.reshape(_load(v_ptrs, run_ok[:, None, None], 0.0, MASKED), [BLOCK_N, HEAD_D])
    ks = 1.0
    vs = 1.0
    if GROUP_SCALES:
        ok = tl.reshape(key_ok, [BLOCK_N])
        # one scale per (group, key), padding keys 0: [NG, BLOCK_N] where they fold into the
        # scores and probabilities or multiply V transposed, [BLOCK_N, NG] to multiply K
        if SCALE_RUNS_DENSE:
            # a run's scales [TP, NG] are contiguous (head-major storage): loaded as
            # [NP, TP * NG], wide copies along each run, then zeroed outside [lo, limit)
            offs_j = tl.arange(0, TP * NG)
            ks = _load(kg_base + (page * s_kgp + tok * NG)[:, None] + offs_j[None, :],
                       run_ok[:, None], 0.0, MASKED)  # fmt: skip
            vs = _load(vg_base + (page * s_vgp + tok * NG)[:, None] + offs_j[None, :],
                       run_ok[:, None], 0.0, MASKED)  # fmt: skip
            ks = tl.reshape(ks, [BLOCK_N, NG])
            vs = tl.reshape(vs, [BLOCK_N, NG])
            if MASKED:
                ks = tl.where(ok[:, None], ks, 0.0)
                vs = tl.where(ok[:, None], vs, 0.0)
            if FOLD:
                ks = tl.trans(ks)
            vs = tl.trans(vs)
        else:
            # per key: page and slot of its run
            key_page = tl.reshape(tl.broadcast_to(page[:, None], [NP, TP]), [BLOCK_N])
            key_tok = tl.reshape(tok[:, None] + offs_t[None, :], [BLOCK_N])
            offs_g = tl.arange(0, NG)
            kg_off = key_page * s_kgp + key_tok * s_kgt
            vg_off = key_page * s_vgp + key_tok * s_vgt
            if FOLD:
                ks = _load(kg_base + kg_off[None, :] + offs_g[:, None], ok[None, :], 0.0, MASKED)
            else:
                ks = _load(kg_base + kg_off[:, None] + offs_g[None, :], ok[:, None], 0.0, MASKED)
            vs = _load(vg_base + vg_off[None, :] + offs_g[:, None], ok[None, :], 0.0, MASKED)
    return k, v, ks, vs


@triton.jit
def _group_dequant(x, xs, NG: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr):
    """FP8 tile ``[BLOCK_N, D]`` times group scales ``[BLOCK_N, NG]`` x 16, in fp16."""
    xs16 = (xs * 16.0).to(tl.float16)
    x3 = tl.reshape(x.to(tl.float16), [BLOCK_N, NG, HEAD_D // NG]) * xs16[:, :, None]
    return tl.reshape(x3, [BLOCK_N, HEAD_D])


@triton.jit
def _group_dequant_t(x, xs, NG: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr):
    """Transposed FP8 tile ``[D, BLOCK_N]`` times group scales ``[NG, BLOCK_N]`` x 16, in fp16."""
    xs16 = (xs * 16.0).to(tl.float16)
    x3 = tl.reshape(x.to(tl.float16), [NG, HEAD_D // NG, BLOCK_N]) * xs16[:, None, :]
    return tl.reshape(x3, [HEAD_D, BLOCK_N])


@triton.jit
def _copy_rows(x, NG: tl.constexpr, RB: tl.constexpr):
    """Per-copy values ``[NG]`` -> one per expanded row (row ``c * RB + r`` gets ``x[c]``)."""
    return tl.reshape(tl.broadcast_to(x[:, None], [NG, RB]), [NG * RB])


@triton.jit
def _copy_tiles(x, NG: tl.constexpr, RB: tl.constexpr, N: tl.constexpr):
    """Per-copy rows ``[NG, N]`` -> ``[NG * RB, N]`` (row ``c * RB + r`` gets ``x[c]``)."""
    return tl.reshape(tl.broadcast_to(x[:, None, :], [NG, RB, N]), [NG * RB, N])


@triton.jit
def _base_rows(x, NG: tl.constexpr, RB: tl.constexpr):
    """Per-row values ``[RB]`` -> the same value on each of the row's ``NG`` copies."""
    return tl.reshape(tl.broadcast_to(x[None, :], [NG, RB]), [NG * RB])


@triton.jit
def capped_scores(s, qk_scale, softcap, USE_SOFTCAP: tl.constexpr):
    """``(scores, multiplier)``: raw scores and ``qk_scale``; with ``USE_SOFTCAP`` the scores in
    natural units capped (``softcap * tanh(x / softcap)``), in log2 units, and 1."""
    s_mult = qk_scale
    if USE_SOFTCAP:
        x = s * (qk_scale / softcap)
        e = tl.exp(2.0 * x)
        s = (softcap * 1.4426950408889634) * (1.0 - 2.0 / (e + 1.0))
        s_mult = 1.0
    return s, s_mult


@triton.jit
def _dot_kt(q, k, BY_SUM: tl.constexpr):
    """``q @ k^T`` in fp32: a tensor-core dot, or with ``BY_SUM`` the fp32 products summed
    (4-bit K tiles of head_dim 16: on an H200 with Triton 3.6 the dot with their transposed
    tile gave wrong scores, while the same tile stored, or used untransposed for V, was right;
    docs/dev/fp4-formats.md)."""
    if BY_SUM:
        return tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], 2)
    return tl.dot(q, tl.trans(k.to(tl.float16)))


@triton.jit
def _qk(q, k, ks, GROUP_SCALES: tl.constexpr, FOLD: tl.constexpr, NG: tl.constexpr,
        RB: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
        K_FP4: tl.constexpr):  # fmt: skip
    """Raw scores ``q @ (k * scales)^T`` ``[RB, BLOCK_N]`` (x 16 for dequantized group scales).

    With ``FOLD`` the query holds ``NG`` copies of each row, copy ``c`` zero outside
    group ``c``: the dot gives every group's partial scores, which are scaled per
    (group, key) and summed over the copies.
    """
    BY_SUM: tl.constexpr = K_FP4 != 0 and HEAD_D < 32
    if FOLD:
        s = _dot_kt(q, k, BY_SUM)
        if NG == 1:
            s = s * ks
        else:
            s = tl.sum(tl.reshape(s * _copy_tiles(ks, NG, RB, BLOCK_N), [NG, RB, BLOCK_N]), 0)
    elif GROUP_SCALES:
        s = tl.dot(q, tl.trans(_group_dequant(k, ks, NG, BLOCK_N, HEAD_D)))
    else:
        s = _dot_kt(q, k, BY_SUM)
    return s


@triton.jit
def _pv(acc, alpha, p, v, vs, GROUP_SCALES: tl.constexpr, FOLD: tl.constexpr,
        NG: tl.constexpr, RB: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr):  # fmt: skip
    """``acc * alpha + p @ (v * scales)`` (x 16 for dequantized group scales).

    With ``FOLD``, ``acc`` is ``[NG * RB, D]``: copy ``c`` of the rows accumulates ``p``
    weighted by group ``c``'s per-key scales (divided by the tile's largest, so that the fp16
    operand keeps the range of ``p`` whatever the size of V); only its group's columns are
    kept at the end.
    """
    if FOLD:
        vs_max = tl.max(vs, 1)
        vs_max = tl.where(vs_max > 0.0, vs_max, 1.0)
        w = vs / vs_max[:, None]
        if NG == 1:
            pw = p * w
            acc = acc * alpha[:, None]
        else:
            pw = tl.reshape(p[None, :, :] * w[:, None, :], [NG * RB, BLOCK_N])
            acc = acc * _base_rows(alpha, NG, RB)[:, None]
        pv = tl.dot(pw.to(tl.float16), v.to(tl.float16))
        acc = acc + pv * _copy_rows(vs_max, NG, RB)[:, None]
    elif GROUP_SCALES:
        # V is transposed: keys stay contiguous in the operand's shared-memory copy (K-major);
        # dequantized before p's fp16 copy exists (the order the H200 timings were taken in)
        v16 = _group_dequant_t(v, vs, NG, BLOCK_N, HEAD_D)
        acc = tl.dot(p.to(tl.float16), tl.trans(v16), acc * alpha[:, None])
    else:
        acc = tl.dot(p.to(tl.float16), v.to(tl.float16), acc * alpha[:, None])
    return acc


@triton.jit
def attn_tile(
    acc,
    m_i,
    l_i,
    q,
    n0,
    lo,
    s_hi,
    pos,
    win,
    qk_scale,
    softcap,
    qcs,
    bt_row,
    k_base,
    v_base,
    kg_base,
    vg_base,
    s_k,
    s_v,
    s_kg,
    s_vg,
    kb_base,
    vb_base,
    s_kb,
    s_vb,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    GROUP_SCALES: tl.constexpr,
    FOLD: tl.constexpr,
    NG: tl.constexpr,
    HAS_OFF: tl.constexpr,
    RB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_D: tl.constexpr,
    PAGE: tl.constexpr,
    TP: tl.constexpr,
    V_RUNS_DENSE: tl.constexpr,
    SCALE_RUNS_DENSE: tl.constexpr,
    K_FP4: tl.constexpr,
    V_FP4: tl.constexpr,
):
    """Online-softmax step over keys ``[n0, n0 + BLOCK_N)``; returns (acc, m, l).

    ``qk_scale`` multiplies the raw scores: in natural units with ``USE_SOFTCAP``, else in
    log2 units and positive. With ``HAS_OFF`` each row's ``qcs`` (``q'·c / k_scale``) is
    added to its scores: before the softcap in raw units with ``USE_SOFTCAP``, else in log2
    units (times ``qk_scale``) to the row maximum and the exponent (the kernel passes it only
    with softcap; without, it shifts the whole online softmax instead).
    """
    k, v, ks, vs = _load_kv(
        n0, lo, s_hi, bt_row, k_base, v_base, kg_base, vg_base, s_k, s_v, s_kg, s_vg, kb_base,
        vb_base, s_kb, s_vb, MASKED, GROUP_SCALES, FOLD, NG, BLOCK_N, HEAD_D, PAGE, TP,
        V_RUNS_DENSE, SCALE_RUNS_DENSE, K_FP4, V_FP4,
    )  # fmt: skip
    if MASKED:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_range = (offs_n >= lo) & (offs_n < s_hi)
        # V rows of keys outside [lo, s_hi) to zero (they were loaded with their whole run)
        if GROUP_SCALES and not FOLD:
            v = tl.where(in_range[None, :], v.to(tl.float16), 0.0)  # transposed
        else:
            v = tl.where(in_range[:, None], v.to(tl.float16), 0.0)
    s = _qk(q, k, ks, GROUP_SCALES, FOLD, NG, RB, BLOCK_N, HEAD_D, K_FP4)
    if HAS_OFF and USE_SOFTCAP:
        s = s + qcs[:, None]
    # scale of the scores in log2 units, applied after the row maximum (it is positive) and
    # joined with the exponent's subtraction in one FMA: no multiply per score
    s, s_mult = capped_scores(s, qk_scale, softcap, USE_SOFTCAP)
    if MASKED:
        vis = in_range[None, :]
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= pos[:, None])
        if USE_WINDOW:
            vis = vis & (offs_n[None, :] > pos[:, None] - win)
        s = tl.where(vis, s, float("-inf"))
    if HAS_OFF and not USE_SOFTCAP:
        # the row's offset term (log2 units) is constant along the row: it joins the row
        # maximum and the exponent's FMA instead of every score
        m_new = tl.maximum(m_i, tl.max(s, 1) * s_mult + qcs)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s * s_mult - (m_use - qcs)[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * s_mult)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s * s_mult - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _pv(acc, alpha, p, v, vs, GROUP_SCALES, FOLD, NG, RB, BLOCK_N, HEAD_D)
    return acc, m_new, l_i

"""``@triton.jit`` programs of paged attention over the FP8 cache: the key loop and the merge.

:func:`paged_attn_kernel` runs one (query block x KV split, KV head, sequence): every query
row of a KV head in one tile, K/V tiles gathered from the pages and converted once for the
whole GQA group, an online softmax over a masked first tile, an unmasked interior and a masked
rest. With several splits it writes partials that :func:`reduce_kernel` merges. Optional
inputs (query lengths, key starts, sinks, the K transform's rotation, offset and first tokens)
are ``None`` when absent, and the code for them compiles only when given. Tile helpers:
:mod:`kvquant.kernels.attention.tile`; launcher: :mod:`kvquant.kernels.attention.launch`; the
design and its measurements: docs/dev/kernels.md. Nothing here validates arguments.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvquant.kernels import specialize
from kvquant.kernels.attention.tile import attn_tile, capped_scores

__all__ = ["paged_attn_kernel", "reduce_kernel"]


@triton.jit
def _first_tokens(
    acc,
    m_i,
    l_i,
    q,
    n_first,
    kv0,
    seq_len,
    pos,
    p_min,
    p_max,
    win,
    qk_scale,
    softcap,
    k_div,
    v_div,
    fk_row,
    fv_row,
    row_stride,
    shift,
    d_q,
    d_o,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    """Online-softmax steps over the first ``n_first`` keys, from the side buffer, one by one.

    Key ``i`` sits at position ``kv0 + i``; ``fk_row`` / ``fv_row`` point at key 0 of this
    (sequence, KV head), keys ``row_stride`` apart. Each key's scores are one fp32 dot per
    row with the query tile, in the paged tiles' raw units (``q'·k / k_scale``, no offset
    term; ``shift`` is subtracted in log2 units, see the caller), and its value enters the
    accumulator's units (``v / v_scale``). No tensor-core tile: the query keeps the layout it
    was loaded in, and the key loops their registers. ``d_q`` / ``d_o``: the head-dim element
    of each column of the query and of the output (the paged tiles' order).
    """
    qf = q.to(tl.float32)
    i = 0
    while i < n_first:  # (a while loop: runtime-bound for loops crash the interpreter on numpy 2.4)
        fk = tl.load(fk_row + i * row_stride + d_q).to(tl.float32)
        fv = tl.load(fv_row + i * row_stride + d_o).to(tl.float32)
        s, s_mult = capped_scores(
            tl.sum(qf * fk[None, :], 1) / k_div, qk_scale, softcap, USE_SOFTCAP
        )
        j = kv0 + i
        vis = j < seq_len
        seen = vis  # some row of the block sees the key
        if CAUSAL:
            vis = vis & (j <= pos)
            seen = seen & (j <= p_max)
        if USE_WINDOW:
            vis = vis & (j > pos - win)
            seen = seen & (j > p_min - win)
        fv = tl.where(seen, fv, 0.0)  # a value no row sees never reaches the output (0 * NaN)
        s = tl.where(vis, s * s_mult - shift, float("-inf"))
        m_new = tl.maximum(m_i, s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * (fv / v_div)[None, :]
        m_i = m_new
        i += 1
    return acc, m_i, l_i


@triton.jit
def _ring_tiles(
    acc,
    m_i,
    l_i,
    q,
    n,
    r_lo,
    ring,
    seq_len,
    pos,
    p_min,
    p_max,
    win,
    qk_scale,
    softcap,
    k_div,
    v_div,
    rk_row,
    rv_row,
    row_stride,
    shift,
    d_q,
    d_o,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    XG: tl.constexpr,
    RB: tl.constexpr,
):
    """Online-softmax steps over the newest ``n`` keys (positions ``r_lo ..``), from the ring,
    16 at a time.

    Key position ``j`` sits in slot ``j % ring``; ``rk_row`` / ``rv_row`` point at slot 0 of
    this (sequence, KV head), slots ``row_stride`` apart. Scores and values join the paged
    tiles' units as the first tokens' do (:func:`_first_tokens`; ``shift`` is ``[RB]``),
    through fp16 tensor-core dots in the keys' and values' own units (the dots' fp32 results
    divided by ``k_div`` / ``v_div``; fp32 dots spilled registers in every program). With
    ``XG`` copies of each query row (folded group scales: copy ``c`` holds group ``c``'s
    columns) the copies' partial scores are summed, and every copy accumulates the values
    (each keeps only its group's columns at the end).
    """
    RT: tl.constexpr = 16
    offs = tl.arange(0, RT)
    i = 0
    while i < n:  # (a while loop: runtime-bound for loops crash the interpreter on numpy 2.4)
        j = r_lo + i + offs
        ok = (i + offs) < n
        slot = j % ring
        k = tl.load(rk_row + slot[:, None] * row_stride + d_q[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(rv_row + slot[:, None] * row_stride + d_o[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float16)))
        if XG > 1:
            s = tl.sum(tl.reshape(s, [XG, RB, RT]), 0)
        s, s_mult = capped_scores(s / k_div, qk_scale, softcap, USE_SOFTCAP)
        vis = (ok & (j < seq_len))[None, :]
        seen = ok & (j < seq_len)  # some row of the block sees the key
        if CAUSAL:
            vis = vis & (j[None, :] <= pos[:, None])
            seen = seen & (j <= p_max)
        if USE_WINDOW:
            vis = vis & (j[None, :] > pos[:, None] - win)
            seen = seen & (j > p_min - win)
        v = tl.where(seen[:, None], v, 0.0)  # 0 * NaN never reaches a row
        s = tl.where(vis, s * s_mult - shift[:, None], float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if XG > 1:
            p = tl.reshape(tl.broadcast_to(p[None, :, :], [XG, RB, RT]), [XG * RB, RT])
            alpha = tl.reshape(tl.broadcast_to(alpha[None, :], [XG, RB]), [XG * RB])
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16)) / v_div
        m_i = m_new
        i += RT
    return acc, m_i, l_i


@specialize.jit(varying=("num_splits",), unaligned=("Lq", "n_qblocks", "s_bt"))
def paged_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_ptr,
    qlen_ptr,
    start_ptr,
    ks_ptr,
    vs_ptr,
    kg_ptr,
    vg_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    sm_scale,
    softcap,
    window,
    Lq,
    Hq,
    n_qblocks,
    num_splits,
    s_q,
    s_k,
    s_v,
    s_bt,
    s_kvs,
    s_kg,
    s_vg,
    s_o,
    sink_ptr,
    rot_ptr,
    off_ptr,
    fk_ptr,
    fv_ptr,
    flen_ptr,
    n_side,
    kb_ptr,
    vb_ptr,
    s_kb,
    s_vb,
    rkv_ptr,
    GROUP: tl.constexpr,
    QPB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_D: tl.constexpr,
    PAGE: tl.constexpr,
    V_RUNS_DENSE: tl.constexpr,
    SCALE_RUNS_DENSE: tl.constexpr,
    FOLD: tl.constexpr,
    NG: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_WHILE: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    PDL: tl.constexpr,
    K_FP4: tl.constexpr,
    V_FP4: tl.constexpr,
):
    """Program (query block x split, KV head, sequence): attention of its rows over its keys.

    Strides come as tuples: ``s_q``, ``s_o`` (batch, token, head, dim), ``s_k``, ``s_v``
    (page, slot, head, dim), ``s_kg``, ``s_vg`` (page, slot, head). The pointers ``qlen_ptr``,
    ``start_ptr``, ``ks_ptr``/``vs_ptr`` (static scales) or ``kg_ptr``/``vg_ptr`` (group
    scales), ``sink_ptr``, ``rot_ptr``, ``off_ptr`` and ``fk_ptr``/``fv_ptr``/``flen_ptr``
    (first tokens) are ``None`` when absent. ``K_FP4`` / ``V_FP4`` (0 FP8, 1 NVFP4, 2 MXFP4,
    plus 4 where inline PTX decodes) pick each side's page format: a 4-bit side's packed pages
    and block scales ``kb_ptr`` / ``vb_ptr`` (strides ``s_kb``, ``s_vb``: page, slot, head) are
    dequantized in registers, NVFP4's global scale folded as a static scale (``ks_ptr`` /
    ``vs_ptr``; MXFP4 passes ones), with the tiles' constant factor (64 or 16); the query and
    the output of a 4-bit side follow its tiles' order of head_dim (``d_q``, ``d_o``).
    """
    HAS_QLEN: tl.constexpr = qlen_ptr is not None
    HAS_START: tl.constexpr = start_ptr is not None
    GROUP_SCALES: tl.constexpr = kg_ptr is not None
    HAS_SINKS: tl.constexpr = sink_ptr is not None
    HAS_ROT: tl.constexpr = rot_ptr is not None
    HAS_OFF: tl.constexpr = off_ptr is not None
    HAS_FIRST: tl.constexpr = fk_ptr is not None
    HAS_RECENT: tl.constexpr = rkv_ptr is not None
    # the side buffers' lengths: first tokens per row, the newest tokens' ring
    n_first_max = n_side[0]
    n_recent_max = n_side[1]
    # keys per run of a tile inside one page: gcd(PAGE, BLOCK_N), BLOCK_N a power of two
    PAGE_POW2: tl.constexpr = PAGE & -PAGE  # the largest power of two dividing PAGE
    TP: tl.constexpr = PAGE_POW2 if PAGE_POW2 < BLOCK_N else BLOCK_N
    if PDL:
        gdc_wait()  # programmatic dependent launch: the previous kernel's writes are visible
    pid0 = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    qb = n_qblocks - 1 - pid0 // num_splits  # heavy causal blocks first
    split = pid0 % num_splits

    seq_len = tl.load(seq_ptr + b)
    if HAS_QLEN:
        q_len = tl.minimum(tl.load(qlen_ptr + b), Lq)
    else:
        q_len = Lq
    if HAS_START:
        kv0 = tl.load(start_ptr + b)
    else:
        kv0 = 0

    # RB rows (query token, head); with FOLD the dots see XG = NG copies of them
    XG: tl.constexpr = NG if FOLD else 1
    RB: tl.constexpr = BLOCK_M // XG
    rows = tl.arange(0, RB)
    t_loc = rows // GROUP
    t = qb * QPB + t_loc
    head = kvh * GROUP + rows % GROUP
    row_in = (t_loc < QPB) & (t < Lq)
    row_valid = row_in & (t < q_len)
    pos = seq_len - q_len + t
    offs_d = tl.arange(0, HEAD_D)
    # head-dim element of each column of the query (d_q) and of the output (d_o): a 4-bit side's
    # tile holds element 4j + 2a + b at column 4j + 2b + a (fp4_tile.load_fp4_tile), so the
    # query of 4-bit K and the output of 4-bit V are loaded and stored in that order
    d_fp4 = (offs_d & -4) | ((offs_d & 1) << 1) | ((offs_d >> 1) & 1)
    d_q = d_fp4 if K_FP4 != 0 else offs_d
    d_o = d_fp4 if V_FP4 != 0 else offs_d

    # query tile [BLOCK_M, D]; copy c of a row keeps only group c's columns
    rows_x = tl.arange(0, BLOCK_M)
    copy_x = rows_x // RB
    t_x = qb * QPB + (rows_x % RB) // GROUP
    head_x = kvh * GROUP + (rows_x % RB) % GROUP
    ok_x = ((rows_x % RB) // GROUP < QPB) & (t_x < Lq) & (t_x < q_len)
    in_copy = (offs_d // (HEAD_D // XG))[None, :] == copy_x[:, None]
    q_ptrs = q_ptr + b.to(tl.int64) * s_q[0] + t_x[:, None] * s_q[1] + head_x[:, None] * s_q[2]
    q_ptrs += d_q[None, :] * s_q[3]
    # with a K rotation the query tile is rotated into the pages' frame in fp32, then cast like
    # any query tile (folded group scales: each row copy keeps its group's rotated columns);
    # with an offset c (static scales), qc = q'·c per row (raw units). A decode launch gets its
    # query rotated by the launcher instead (fp32, no rot_ptr: one product for every program)
    qc = 0.0
    if HAS_ROT:
        # q @ R over RK-column slices of the query (RK rows of R at a time in registers), one
        # TF32 tensor-core dot per slice (docs/dev/kernels.md, retired experiments)
        RK: tl.constexpr = 16
        offs_k = tl.arange(0, RK)
        q_rows = q_ptr + b.to(tl.int64) * s_q[0] + t_x[:, None] * s_q[1] + head_x[:, None] * s_q[2]
        q32 = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
        # a loop, so that R's rows are not all hoisted into registers
        for k0 in tl.range(0, HEAD_D, RK, num_stages=1):
            q_k = tl.load(q_rows + (k0 + offs_k)[None, :] * s_q[3], mask=ok_x[:, None], other=0.0)
            r_k = tl.load(rot_ptr + (k0 + offs_k)[:, None] * HEAD_D + d_q[None, :])
            q32 = tl.dot(q_k.to(tl.float32), r_k, q32, input_precision="tf32")
        if XG > 1:
            q32 = tl.where(in_copy, q32, 0.0)
        if HAS_OFF:
            # the offset's term from the fp32 rotated query, while it is live (taken from its
            # fp16 copy, it kept ~80 more registers live with tensor-core rotations)
            off_c = tl.load(off_ptr + kvh * HEAD_D + d_q)
            qc = tl.sum(q32 * off_c[None, :], 1)
        q = q32.to(tl.float16)
    else:
        q_in = tl.load(q_ptrs, mask=ok_x[:, None] & in_copy, other=0.0)
        if HAS_OFF:
            # from the query as given (fp32 when the launcher rotated a decode query first)
            off_c = tl.load(off_ptr + kvh * HEAD_D + d_q)
            qc = tl.sum(q_in.to(tl.float32) * off_c[None, :], 1)
        q = q_in.to(tl.float16)
    n_first = 0
    if HAS_FIRST:
        # first tokens: keys kv0 .. kv0 + n_first - 1 come from the side buffer (split 0)
        flen = tl.load(flen_ptr + b)
        n_first = tl.minimum(tl.minimum(flen, n_first_max), seq_len - kv0)
        n_first = tl.maximum(n_first, 0)

    # key range of this query block: [lo, hi)
    t_first = qb * QPB
    t_last = tl.minimum(t_first + QPB, q_len) - 1
    p_min = seq_len - q_len + t_first
    p_max = seq_len - q_len + t_last
    lo = kv0 + n_first
    # the newest tokens: keys r_lo .. seq_len - 1 come from the ring (split 0), after the
    # first tokens
    r_lo = seq_len
    if HAS_RECENT:
        r_lo = tl.maximum(kv0 + n_first, seq_len - n_recent_max)
    if USE_WINDOW:
        lo = tl.maximum(lo, p_min - window + 1)
    hi = r_lo
    if CAUSAL:
        hi = tl.minimum(hi, p_max + 1)
    hi = tl.where(t_last >= t_first, hi, lo)
    hi = tl.maximum(hi, lo)
    # this split's share, in whole tiles aligned to multiples of BLOCK_N
    lo_al = lo - lo % BLOCK_N
    n_tiles = (hi - lo_al + BLOCK_N - 1) // BLOCK_N
    per_split = (n_tiles + num_splits - 1) // num_splits
    s_lo = tl.minimum(lo_al + split * per_split * BLOCK_N, hi)
    s_hi = tl.minimum(s_lo + per_split * BLOCK_N, hi)
    # [s_lo, int_lo): a masked first tile holding keys before lo (split 0 only, lo unaligned);
    # [int_lo, mid): unmasked interior, keys visible to every row of the block;
    # [mid, s_hi): masked rest (causal diagonal, tail, sliding window)
    int_lo = tl.maximum(s_lo, (lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
    head_hi = tl.minimum(int_lo, s_hi)
    if CAUSAL:
        full_hi = tl.minimum(p_min + 1, s_hi)
    else:
        full_hi = s_hi
    if USE_WINDOW:
        mid = int_lo
    else:
        mid = int_lo + tl.maximum(full_hi - int_lo, 0) // BLOCK_N * BLOCK_N

    # k_mult / v_mult: the tiles' units (a full-precision key or value from a side buffer is
    # divided by them to join the paged ones)
    if FOLD:
        qk_scale = sm_scale
        k_mult = 1.0
        v_mult = 1.0
    elif GROUP_SCALES:
        # tiles were dequantized with scales x 16 (fp16-normal down to amax ~1.7e-3)
        qk_scale = sm_scale * 0.0625
        k_mult = 0.0625
        v_mult = 0.0625
    else:
        k_mult = tl.load(ks_ptr + kvh * s_kvs[0])
        v_mult = tl.load(vs_ptr + kvh * s_kvs[1])
        # a 4-bit side's tiles are its values over 64 (NVFP4, without g) or 16 (MXFP4), exact
        # in fp16 (fp4_tile.load_fp4_tile): the factor joins the static multiplier
        if K_FP4 != 0:
            k_mult = k_mult * (64.0 if K_FP4 % 4 == 1 else 16.0)
        if V_FP4 != 0:
            v_mult = v_mult * (64.0 if V_FP4 % 4 == 1 else 16.0)
        qk_scale = sm_scale * k_mult
    if not USE_SOFTCAP:
        # the tiles take the exponent's scale in log2 units, made positive: its sign goes into
        # the query (exact in fp16), so that it commutes with the row maximum; 0 becomes 1e-30
        # (scores ~0, the same uniform weights), NaN stays NaN
        qk_scale = qk_scale * 1.4426950408889634
    qcs = 0.0
    if HAS_OFF:
        # (q @ R)·c per row in the paged scores' raw units; without softcap in log2 units
        # (the tiles add it to the row maximum), with the signed scale (the query is unflipped)
        qcs = qc / k_mult
        if not USE_SOFTCAP:
            qcs = qcs * qk_scale
    if not USE_SOFTCAP:
        q = tl.where(qk_scale < 0.0, -q, q)
        qk_scale = tl.where(qk_scale == 0.0, 1e-30, tl.abs(qk_scale))
    # Without softcap the offset's term is constant along each row, and the online softmax is
    # shift invariant: it runs in a frame shifted by -qcs (paged scores without the term, the
    # first tokens' minus it), and the row maximum gets it back at the end (the split's
    # log-sum-exp, the sink), so the key loops carry no per-row term. With softcap it goes
    # into every score before the cap.
    OFF_IN_TILE: tl.constexpr = HAS_OFF and USE_SOFTCAP
    shift = 0.0
    if HAS_OFF and not USE_SOFTCAP:
        shift = qcs

    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    k_base = k_ptr + kvh * s_k[2]
    v_base = v_ptr + kvh * s_v[2]
    if GROUP_SCALES:
        kg_base = kg_ptr + kvh * s_kg[2]
        vg_base = vg_ptr + kvh * s_vg[2]
    else:  # never read
        kg_base = k_base
        vg_base = v_base
    # an NVFP4 side's block scales: each row's HEAD_D // 16 bytes at a multiple of that (the plan
    # checks the address and strides), so that a row is one vector load; MXFP4's rows are left
    # unhinted (the hint costs its decode registers and occupancy)
    if K_FP4 % 4 == 1:
        kb_base = kb_ptr + tl.multiple_of(kvh * s_kb[2], HEAD_D // 16)
    elif K_FP4 != 0:
        kb_base = kb_ptr + kvh * s_kb[2]
    else:  # never read
        kb_base = k_base
    if V_FP4 % 4 == 1:
        vb_base = vb_ptr + tl.multiple_of(kvh * s_vb[2], HEAD_D // 16)
    elif V_FP4 != 0:
        vb_base = vb_ptr + kvh * s_vb[2]
    else:  # never read
        vb_base = v_base

    m_i = tl.full([RB], float("-inf"), tl.float32)
    l_i = tl.zeros([RB], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    if HAS_FIRST:
        # the first tokens' keys start the online softmax (it is order-free), key by key
        row_stride = (Hq // GROUP) * HEAD_D
        first_off = (b.to(tl.int64) * n_first_max * (Hq // GROUP) + kvh) * HEAD_D
        acc, m_i, l_i = _first_tokens(
            acc, m_i, l_i, q, tl.where(split == 0, n_first, 0), kv0, seq_len, pos,
            p_min, p_max, window, qk_scale, softcap, k_mult, v_mult, fk_ptr + first_off,
            fv_ptr + first_off, row_stride, shift, d_q, d_o, CAUSAL, USE_WINDOW, USE_SOFTCAP,
        )  # fmt: skip

    if HAS_RECENT:
        row_stride = (Hq // GROUP) * HEAD_D
        # [B, 2, R, Hkv, D]: a sequence's keys' ring, then its values'
        v_ring = n_recent_max * row_stride
        ring_off = b.to(tl.int64) * 2 * v_ring + kvh * HEAD_D
        acc, m_i, l_i = _ring_tiles(
            acc, m_i, l_i, q, tl.where(split == 0, seq_len - r_lo, 0), r_lo, n_recent_max,
            seq_len, pos, p_min, p_max, window, qk_scale, softcap, k_mult, v_mult,
            rkv_ptr + ring_off, rkv_ptr + v_ring + ring_off, row_stride,
            shift + tl.zeros([RB], tl.float32), d_q, d_o,
            CAUSAL, USE_WINDOW, USE_SOFTCAP, XG, RB,
        )  # fmt: skip

    # the three key ranges, the masked ones with MASKED tiles
    if USE_WHILE:  # (the interpreter: runtime-bound for loops crash it on numpy 2.4)
        n0 = s_lo
        while n0 < head_hi:
            acc, m_i, l_i = attn_tile(
                acc, m_i, l_i, q, n0, lo, s_hi, pos, window, qk_scale, softcap, qcs,
                bt_row, k_base, v_base, kg_base, vg_base, s_k, s_v, s_kg, s_vg, kb_base, vb_base, s_kb,
                s_vb,
                True, CAUSAL, USE_WINDOW, USE_SOFTCAP, GROUP_SCALES, FOLD, NG, OFF_IN_TILE,
                RB, BLOCK_N, HEAD_D, PAGE, TP, V_RUNS_DENSE, SCALE_RUNS_DENSE, K_FP4, V_FP4,
            )  # fmt: skip
            n0 += BLOCK_N
        n0 = int_lo
        while n0 < mid:
            acc, m_i, l_i = attn_tile(
                acc, m_i, l_i, q, n0, lo, s_hi, pos, window, qk_scale, softcap, qcs,
                bt_row, k_base, v_base, kg_base, vg_base, s_k, s_v, s_kg, s_vg, kb_base, vb_base, s_kb,
                s_vb,
                False, CAUSAL, USE_WINDOW, USE_SOFTCAP, GROUP_SCALES, FOLD, NG, OFF_IN_TILE,
                RB, BLOCK_N, HEAD_D, PAGE, TP, V_RUNS_DENSE, SCALE_RUNS_DENSE, K_FP4, V_FP4,
            )  # fmt: skip
            n0 += BLOCK_N
        while n0 < s_hi:
            acc, m_i, l_i = attn_tile(
                acc, m_i, l_i, q, n0, lo, s_hi, pos, window, qk_scale, softcap, qcs,
                bt_row, k_base, v_base, kg_base, vg_base, s_k, s_v, s_kg, s_vg, kb_base, vb_base, s_kb,
                s_vb,
                True, CAUSAL, USE_WINDOW, USE_SOFTCAP, GROUP_SCALES, FOLD, NG, OFF_IN_TILE,
                RB, BLOCK_N, HEAD_D, PAGE, TP, V_RUNS_DENSE, SCALE_RUNS_DENSE, K_FP4, V_FP4,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in tl.range(s_lo, head_hi, BLOCK_N, num_stages=1):
            n0 = tl.multiple_of(n0, BLOCK_N)
            acc, m_i, l_i = attn_tile(
                acc, m_i, l_i, q, n0, lo, s_hi, pos, window, qk_scale, softcap, qcs,
                bt_row, k_base, v_base, kg_base, vg_base, s_k, s_v, s_kg, s_vg, kb_base, vb_base, s_kb,
                s_vb,
                True, CAUSAL, USE_WINDOW, USE_SOFTCAP, GROUP_SCALES, FOLD, NG, OFF_IN_TILE,
                RB, BLOCK_N, HEAD_D, PAGE, TP, V_RUNS_DENSE, SCALE_RUNS_DENSE, K_FP4, V_FP4,
            )  # fmt: skip
        for n0 in tl.range(int_lo, mid, BLOCK_N, num_stages=LOOP_STAGES):
            n0 = tl.multiple_of(n0, BLOCK_N)
            acc, m_i, l_i = attn_tile(
                acc, m_i, l_i, q, n0, lo, s_hi, pos, window, qk_scale, softcap, qcs,
                bt_row, k_base, v_base, kg_base, vg_base, s_k, s_v, s_kg, s_vg, kb_base, vb_base, s_kb,
                s_vb,
                False, CAUSAL, USE_WINDOW, USE_SOFTCAP, GROUP_SCALES, FOLD, NG, OFF_IN_TILE,
                RB, BLOCK_N, HEAD_D, PAGE, TP, V_RUNS_DENSE, SCALE_RUNS_DENSE, K_FP4, V_FP4,
            )  # fmt: skip
        for n0 in tl.range(mid, s_hi, BLOCK_N, num_stages=1):
            n0 = tl.multiple_of(n0, BLOCK_N)
            acc, m_i, l_i = attn_tile(
                acc, m_i, l_i, q, n0, lo, s_hi, pos, window, qk_scale, softcap, qcs,
                bt_row, k_base, v_base, kg_base, vg_base, s_k, s_v, s_kg, s_vg, kb_base, vb_base, s_kb,
                s_vb,
                True, CAUSAL, USE_WINDOW, USE_SOFTCAP, GROUP_SCALES, FOLD, NG, OFF_IN_TILE,
                RB, BLOCK_N, HEAD_D, PAGE, TP, V_RUNS_DENSE, SCALE_RUNS_DENSE, K_FP4, V_FP4,
            )  # fmt: skip

    if PDL:
        gdc_launch_dependents()  # the split reduction may launch (it waits for our stores)
    if XG > 1:
        # each row's copy c contributes group c's columns
        acc = tl.sum(tl.reshape(tl.where(in_copy, acc, 0.0), [XG, RB, HEAD_D]), 0)
    has_key = l_i != 0.0  # NaN (a NaN key or value, an overflow) must reach the output
    if HAS_SINKS and not SPLIT:
        # the sink's term of the softmax denominator, in the rows' log2 units (the split
        # reduction adds it once, after merging)
        sink = tl.load(sink_ptr + head, mask=row_in, other=0.0) * 1.4426950408889634
        l_i += tl.where(has_key, tl.exp2(sink - (m_i + shift)), 0.0)
    l_safe = tl.where(has_key, l_i, 1.0)
    keep = has_key & row_valid
    o = tl.where(keep[:, None], acc * (v_mult / l_safe)[:, None], 0.0)
    if SPLIT:
        prow = ((b.to(tl.int64) * Lq + t) * Hq + head) * num_splits + split
        lse = tl.where(keep, m_i + shift + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + prow, lse, mask=row_in)
        tl.store(part_ptr + prow[:, None] * HEAD_D + d_o[None, :], o, mask=row_in[:, None])
    else:
        o_ptrs = out_ptr + b.to(tl.int64) * s_o[0] + t[:, None] * s_o[1] + head[:, None] * s_o[2]
        o_ptrs += d_o[None, :] * s_o[3]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_in[:, None])


@specialize.jit(varying=("num_splits",), unaligned=("Lq",))
def reduce_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    Lq,
    Hq,
    num_splits,
    s_ob,
    s_ot,
    s_oh,
    s_od,
    sink_ptr,
    SPLITS_P2: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge the split partials of ``BLOCK_D`` columns of one output row (sequence, token, head).

    ``sink_ptr`` is ``None`` without attention sinks.
    """
    if PDL:
        gdc_wait()  # launched early: the partials are complete only after this
    row = tl.program_id(0)
    h = row % Hq
    t = (row // Hq) % Lq
    b = row // (Hq * Lq)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    base = row.to(tl.int64) * num_splits
    lse = tl.load(lse_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    part = tl.load(
        part_ptr + (base + offs_s)[:, None] * HEAD_D + offs_d[None, :],
        mask=s_ok[:, None],
        other=0.0,
    )
    m = tl.max(lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_use)
    denom = tl.sum(w, 0)
    acc = tl.sum(w[:, None] * part, 0)
    if sink_ptr is not None:  # the sink's term of the denominator, once (no key: output 0)
        sink = tl.load(sink_ptr + h) * 1.4426950408889634
        denom += tl.where(m == float("-inf"), 0.0, tl.exp2(sink - m_use))
    o = acc / tl.where(denom > 0.0, denom, 1.0)
    o_ptrs = out_ptr + b.to(tl.int64) * s_ob + t * s_ot + h * s_oh + offs_d * s_od
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty))

"""Triton kernels for attention over the paged FP8 KV cache (decode and prefill/extend).

One kernel serves both regimes. A program owns one (sequence, KV head, query
block, KV split) and holds every query row of that KV head in one tile of
``BLOCK_M`` rows, a row being one (query token, head within the GQA group)
pair: row ``r`` is token ``r // GROUP`` and head ``r % GROUP``. Each K/V tile
of ``BLOCK_N`` keys is therefore gathered from the pages and converted from
FP8 to fp16 once for the whole group, and both products are tensor-core
``tl.dot`` calls on fp16 operands with fp32 accumulation.

* **Decode** (``Lq * group`` small): one query block holds all ``Lq`` tokens;
  the key range is cut into ``num_splits`` contiguous splits
  (flash-decoding) chosen to fill the GPU; each split writes a normalised
  partial output and its log-sum-exp (base 2), and :func:`_reduce_kernel`
  merges them. With one split the kernel writes the output directly.
* **Prefill / extend** (``Lq * group`` large): ``QPB = BLOCK_M // GROUP``
  query tokens per program, heavy causal blocks launched first, one split.

Scales: static per-tensor / per-KV-head scales are folded out of the loop
(``k_scale`` into the exp2 scale of the scores, ``v_scale`` onto the output). The exp2
scale is made positive (its sign goes into the query), so that it multiplies the row
maximum of the raw scores and joins the exponent's subtraction in one FMA.
fp32 group scales ``[num_pages, page_size, Hkv, D // G]`` are folded too in
decode: the query tile holds ``NG = D // G`` copies of each row, copy ``c``
zero outside group ``c``, so one dot gives every group's partial scores; they
are scaled per (group, key) and summed over the copies (K), and copy ``c`` of
the probabilities is weighted by group ``c``'s per-key V scales (divided by the
tile's largest, so that the fp16 operand keeps the range of ``p``) and keeps
group ``c``'s output columns (V). No per-element multiply, no range limit; the
row copies fill the padding rows of the 16-row tensor-core tile (GQA 4 with
``G = D / 2`` costs nothing), up to ``_FOLD_MAX_ROWS`` rows. Otherwise (prefill,
or too many rows) each tile is dequantized in registers in fp16 (one packed
multiply per element pair), the scales multiplied by 16 so that groups with
amax down to ~1.7e-3 stay fp16-normal, and the 16 folded out of the scores and
the output.

On sm_90 and newer both kernels are launched with programmatic dependent
launch: the attention kernel lets the split reduction launch as its programs
finish, and the reduction waits (``griddepcontrol.wait``) for all of its stores.

Tiles start at multiples of ``BLOCK_N`` and are gathered as runs of
``TP = gcd(page_size, BLOCK_N)`` keys, each inside one page: one block-table
entry per run, and the pages' stride-1 axis gives wide copies. V pages stored
keys-fastest (:func:`kvquant.kernels.page_storage`) reach ``P @ V``, which
contracts over keys, through ``ldmatrix``; token-major FP8 V tiles are read
byte by byte from shared memory (Triton has no 8-bit transposing load on
sm_90). Dequantized tiles take V transposed, ``[D, BLOCK_N]``, so that its fp16
copy keeps keys contiguous in shared memory. Where a run's ``[D, TP]`` block of V
(keys-fastest, ``TP`` the page size), or its ``[TP, NG]`` group scales (head-major),
are one contiguous span, they are loaded as one flat row per run: a warp's copies are
then contiguous in the shared-memory staging buffer too (no bank conflicts). Any page
strides work.

The static K transform (``k-transform``, static scales only) is folded in the same way:
with a rotation ``R`` the query tile is rotated once per program (``tl.dot`` of fp32 operands
over 16-row slices of ``R``, ``input_precision=ROT_PREC``: ``"ieee"`` on CUDA cores, ``"tf32x3"``
or ``"tf32"`` on tensor cores) before its fp16 cast, unless the launcher rotated the query
before the launch (then ``HAS_ROT`` is off); with an offset
``c`` each row's ``(q @ R)·c / k_scale`` (one dot per row) is constant along the row: without
softcap the online softmax runs shifted by it (the first tokens' scores take the shift, the
split's log-sum-exp and the sink's term take it back), so the paged tiles never see it; with
softcap it is added to the scores before the cap; with first tokens the online softmax starts from the side
buffer's keys (``first_k``, rotated frame, ``first_v``), one fp32 dot per row and key, in
split 0 only, while the paged range starts after them. All of it sits behind
``tl.constexpr`` flags (``HAS_ROT``, ``HAS_OFF``, ``HAS_FIRST``): the other formats compile
to the code they had. Further flags order the transform's work before the key loop (the
launcher's latency choices, :mod:`kvquant.kernels.tuning`): ``ROT_SLICE`` / ``ROT_STAGES``
(rows of R per rotation step, software pipelining of that loop), ``ROT_HADAMARD`` (R's
slices computed from their indices), ``EARLY_LOADS`` (the transform's independent loads
first), ``FIRST_SPLIT_LAST`` (the last split attends the first tokens), ``FIRST_IN_MERGE``
(decode: :func:`_reduce_first_kernel`, the split merge, attends the first tokens; the attention programs only start
their key range after them, and with a rotation split 0 stores its rotated query rows for
the merge) and, for any format, ``SPLIT_FROM_END`` (split 0 takes the remainder of the key
tiles).

The key loop is split into a masked first tile (keys before the first visible
one, e.g. left padding), an unmasked interior (every key visible to every row
of the block) and a masked rest (causal diagonal, tail, sliding window).

This module holds the ``@triton.jit`` kernels only: the launcher is
:mod:`kvquant.kernels.attention_triton` and its tile and split choices are in
:mod:`kvquant.kernels.tuning`. Nothing here validates arguments
(:mod:`kvquant.kernels` does, before dispatching). Restrictions the kernels rely on: ``head_dim`` a power of
two (>= 16), group scales and block tables contiguous in their last
dimension, ``D // G`` a power of two, queries within fp16 range (|q| < 65504), and, with
fp32 group scales dequantized in tiles (prefill), K/V values below 4094 in magnitude (fp16
range after the x16 boost; beyond it the output turns inf/NaN, never silently wrong).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvquant.kernels import specialize

__all__ = ["_paged_attn_kernel", "_reduce_first_kernel", "_reduce_kernel"]


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
    s_kp,
    s_kt,
    s_kd,
    s_vp,
    s_vt,
    s_vd,
    s_kgp,
    s_kgt,
    s_vgp,
    s_vgt,
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
):
    """Gather the raw FP8 tiles ``[BLOCK_N, D]`` of keys ``n0 + i`` and their group scales.

    ``n0`` is a multiple of ``TP``, which divides ``PAGE``: the tile is ``BLOCK_N // TP``
    runs of ``TP`` keys, each inside one page, so each run takes one block-table entry, and
    a stride-1 axis (head dim, or keys for V stored keys-fastest) gives wide copies. Masked
    tiles load only keys in ``[lo, limit)``. Returns ``(k, v, ks, vs)``. With dequantized
    group scales ``v`` is transposed, ``[D, BLOCK_N]``, and ``ks`` is ``[BLOCK_N, NG]``; the
    other group scales are ``[NG, BLOCK_N]``; without group scales they are placeholders.
    """
    NP: tl.constexpr = BLOCK_N // TP
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
def _qk(q, k, ks, GROUP_SCALES: tl.constexpr, FOLD: tl.constexpr, NG: tl.constexpr,
        RB: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr):  # fmt: skip
    """Raw scores ``q @ (k * scales)^T`` ``[RB, BLOCK_N]`` (x 16 for dequantized group scales).

    With ``FOLD`` the query holds ``NG`` copies of each row, copy ``c`` zero outside
    group ``c``: the dot gives every group's partial scores, which are scaled per
    (group, key) and summed over the copies.
    """
    if FOLD:
        s = tl.dot(q, tl.trans(k.to(tl.float16)))
        if NG == 1:
            s = s * ks
        else:
            s = tl.sum(tl.reshape(s * _copy_tiles(ks, NG, RB, BLOCK_N), [NG, RB, BLOCK_N]), 0)
    elif GROUP_SCALES:
        s = tl.dot(q, tl.trans(_group_dequant(k, ks, NG, BLOCK_N, HEAD_D)))
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float16)))
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
def _attn_tile(
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
    s_kp,
    s_kt,
    s_kd,
    s_vp,
    s_vt,
    s_vd,
    s_kgp,
    s_kgt,
    s_vgp,
    s_vgt,
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
):
    """Online-softmax step over keys ``[n0, n0 + BLOCK_N)``; returns (acc, m, l).

    ``qk_scale`` multiplies the raw scores: in natural units with ``USE_SOFTCAP``, else in
    log2 units and positive. With ``HAS_OFF`` each row's ``qcs`` (``q'·c / k_scale``) is
    added to its scores: before the softcap in raw units with ``USE_SOFTCAP``, else in log2
    units (times ``qk_scale``) to the row maximum and the exponent (the kernel passes it only
    with softcap; without, it shifts the whole online softmax instead).
    """
    k, v, ks, vs = _load_kv(
        n0, lo, s_hi, bt_row, k_base, v_base, kg_base, vg_base,
        s_kp, s_kt, s_kd, s_vp, s_vt, s_vd, s_kgp, s_kgt, s_vgp, s_vgt,
        MASKED, GROUP_SCALES, FOLD, NG, BLOCK_N, HEAD_D, PAGE, TP, V_RUNS_DENSE, SCALE_RUNS_DENSE,
    )  # fmt: skip
    if MASKED:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_range = (offs_n >= lo) & (offs_n < s_hi)
        # V rows of keys outside [lo, s_hi) to zero (they were loaded with their whole run)
        if GROUP_SCALES and not FOLD:
            v = tl.where(in_range[None, :], v.to(tl.float16), 0.0)  # transposed
        else:
            v = tl.where(in_range[:, None], v.to(tl.float16), 0.0)
    s = _qk(q, k, ks, GROUP_SCALES, FOLD, NG, RB, BLOCK_N, HEAD_D)
    if HAS_OFF and USE_SOFTCAP:
        s = s + qcs[:, None]
    # scale of the scores in log2 units, applied after the row maximum (it is positive) and
    # joined with the exponent's subtraction in one FMA: no multiply per score
    s_mult = qk_scale
    if USE_SOFTCAP:
        # scores in natural units, capped: softcap * tanh(x / softcap), then to log2 units
        x = s * (qk_scale / softcap)
        e = tl.exp(2.0 * x)
        s = (softcap * 1.4426950408889634) * (1.0 - 2.0 / (e + 1.0))
        s_mult = 1.0
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


@triton.jit
def _hadamard_signs(x):
    """``(-1) ** popcount(x)`` as fp32 (``0 <= x < 65536``): the parity of ``x``'s bits, folded."""
    x = x ^ (x >> 8)
    x = x ^ (x >> 4)
    x = x ^ (x >> 2)
    x = x ^ (x >> 1)
    return 1.0 - 2.0 * (x & 1).to(tl.float32)


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
    fk_next,
    fv_next,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    HEAD_D: tl.constexpr,
    PRELOADED: tl.constexpr,
):
    """Online-softmax steps over the first ``n_first`` keys, from the side buffer, one by one.

    Key ``i`` sits at position ``kv0 + i``; ``fk_row`` / ``fv_row`` point at key 0 of this
    (sequence, KV head), keys ``row_stride`` apart. Each key's scores are one fp32 dot per
    row with the query tile, in the paged tiles' raw units (``q'·k / k_scale``, no offset
    term; ``shift`` is subtracted in log2 units, see the caller), and its value enters the
    accumulator's units (``v / v_scale``). No tensor-core
    tile: the query keeps the layout it was loaded in, and the key loops their registers.
    With ``PRELOADED`` the caller loaded key 0 (``fk_next``, ``fv_next``) at the start of the
    program, and each step loads the next key before it uses the current one, so no step
    waits for its own load; otherwise each step loads its key (the two arguments unused).
    """
    offs_d = tl.arange(0, HEAD_D)
    qf = q.to(tl.float32)
    i = 0
    while i < n_first:  # (a while loop: runtime-bound for loops crash the interpreter on numpy 2.4)
        if PRELOADED:
            fk = fk_next.to(tl.float32)
            fv = fv_next.to(tl.float32)
            more = offs_d < tl.where(i + 1 < n_first, HEAD_D, 0)
            fk_next = tl.load(fk_row + (i + 1) * row_stride + offs_d, mask=more, other=0.0)
            fv_next = tl.load(fv_row + (i + 1) * row_stride + offs_d, mask=more, other=0.0)
        else:
            fk = tl.load(fk_row + i * row_stride + offs_d).to(tl.float32)
            fv = tl.load(fv_row + i * row_stride + offs_d).to(tl.float32)
        s = tl.sum(qf * fk[None, :], 1) / k_div
        s_mult = qk_scale
        if USE_SOFTCAP:
            x = s * (qk_scale / softcap)
            e = tl.exp(2.0 * x)
            s = (softcap * 1.4426950408889634) * (1.0 - 2.0 / (e + 1.0))
            s_mult = 1.0
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


@specialize.jit(varying=("num_splits",), unaligned=("Lq", "n_qblocks", "s_bt"))
def _paged_attn_kernel(
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
    s_qb,
    s_qt,
    s_qh,
    s_qd,
    s_kp,
    s_kt,
    s_kh,
    s_kd,
    s_vp,
    s_vt,
    s_vh,
    s_vd,
    s_bt,
    s_ks,
    s_vs,
    s_kgp,
    s_kgt,
    s_kgh,
    s_vgp,
    s_vgt,
    s_vgh,
    s_ob,
    s_ot,
    s_oh,
    s_od,
    sink_ptr,
    rot_ptr,
    off_ptr,
    fk_ptr,
    fv_ptr,
    flen_ptr,
    n_first_max,
    qr_ptr,
    HAS_QLEN: tl.constexpr,
    HAS_START: tl.constexpr,
    GROUP: tl.constexpr,
    QPB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_D: tl.constexpr,
    PAGE: tl.constexpr,
    TP: tl.constexpr,
    V_RUNS_DENSE: tl.constexpr,
    SCALE_RUNS_DENSE: tl.constexpr,
    GROUP_SCALES: tl.constexpr,
    FOLD: tl.constexpr,
    NG: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_WHILE: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    PDL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_ROT: tl.constexpr,
    HAS_OFF: tl.constexpr,
    HAS_FIRST: tl.constexpr,
    ROT_PREC: tl.constexpr,
    ROT_SLICE: tl.constexpr,
    ROT_STAGES: tl.constexpr,
    EARLY_LOADS: tl.constexpr,
    FIRST_SPLIT_LAST: tl.constexpr,
    ROT_HADAMARD: tl.constexpr,
    SPLIT_FROM_END: tl.constexpr,
    FIRST_IN_MERGE: tl.constexpr,
):
    """Program (query block x split, KV head, sequence): attention of its rows over its keys."""
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
    # the split that attends the first tokens: split 0, or the last (whose key range is the
    # shortest when the tiles do not divide evenly)
    first_split = num_splits - 1 if FIRST_SPLIT_LAST else 0
    if EARLY_LOADS:
        # the transform's loads that depend on nothing computed (static scales only): issued
        # here, before the query rotation, so that their latencies overlap its loads instead
        # of following them
        k_mult = tl.load(ks_ptr + kvh * s_ks)
        v_mult = tl.load(vs_ptr + kvh * s_vs)
        if HAS_OFF:
            off_c = tl.load(off_ptr + kvh * HEAD_D + tl.arange(0, HEAD_D))
        if HAS_FIRST:
            flen = tl.load(flen_ptr + b)
        if HAS_FIRST and not FIRST_IN_MERGE:
            # key 0 of the first tokens (only the program that attends them reads it)
            first_off = (b.to(tl.int64) * n_first_max * (Hq // GROUP) + kvh) * HEAD_D
            # (masks as a comparison of the offsets: the interpreter refuses a scalar's)
            f0_on = (split == first_split) & (n_first_max > 0)
            f0_ok = tl.arange(0, HEAD_D) < tl.where(f0_on, HEAD_D, 0)
            fk0 = tl.load(fk_ptr + first_off + tl.arange(0, HEAD_D), mask=f0_ok, other=0.0)
            fv0 = tl.load(fv_ptr + first_off + tl.arange(0, HEAD_D), mask=f0_ok, other=0.0)

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

    # query tile [BLOCK_M, D]; copy c of a row keeps only group c's columns
    rows_x = tl.arange(0, BLOCK_M)
    copy_x = rows_x // RB
    t_x = qb * QPB + (rows_x % RB) // GROUP
    head_x = kvh * GROUP + (rows_x % RB) % GROUP
    ok_x = ((rows_x % RB) // GROUP < QPB) & (t_x < Lq) & (t_x < q_len)
    in_copy = (offs_d // (HEAD_D // XG))[None, :] == copy_x[:, None]
    q_ptrs = q_ptr + b.to(tl.int64) * s_qb + t_x[:, None] * s_qt + head_x[:, None] * s_qh
    q_ptrs += offs_d[None, :] * s_qd
    # with a K rotation (static scales: XG = 1, BLOCK_M = RB) the query tile is rotated into
    # the pages' frame in fp32, then cast like any query tile; with an offset c, qc = q'·c
    # per row (raw units)
    qc = 0.0
    if HAS_ROT:
        # q @ R over RK-column slices of the query (RK rows of R at a time in registers);
        # with ROT_HADAMARD, R is the Sylvester Hadamard matrix (the launcher checked it) and
        # its rows are computed from their indices instead of loaded
        RK: tl.constexpr = ROT_SLICE
        offs_k = tl.arange(0, RK)
        q_rows = q_ptr + b.to(tl.int64) * s_qb + t_x[:, None] * s_qt + head_x[:, None] * s_qh
        q32 = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
        if ROT_HADAMARD:
            # H[i, j] = (-1) ** popcount(i & j) / sqrt(D): with i = k0 + r (k0 a multiple of
            # RK, r < RK) the bits of k0 & j and r & j are disjoint, so slice k0 of H is the
            # loop-invariant H[r, j] times the sign of each column j, popcount(k0 & j)
            h_lo = _hadamard_signs(offs_k[:, None] & offs_d[None, :]) * (HEAD_D**-0.5)
        # a loop, so that R's rows are not all hoisted into registers; with ROT_STAGES > 1
        # software-pipelined (slices i + 1.. copied to shared memory during slice i's dot)
        for k0 in tl.range(0, HEAD_D, RK, num_stages=ROT_STAGES):
            q_k = tl.load(q_rows + (k0 + offs_k)[None, :] * s_qd, mask=ok_x[:, None], other=0.0)
            if ROT_HADAMARD:
                r_k = h_lo * _hadamard_signs(k0 & offs_d)[None, :]
            else:
                r_k = tl.load(rot_ptr + (k0 + offs_k)[:, None] * HEAD_D + offs_d[None, :])
            q32 = tl.dot(q_k.to(tl.float32), r_k, q32, input_precision=ROT_PREC)
        if HAS_OFF:
            # the offset's term from the fp32 rotated query, while it is live (taken from its
            # fp16 copy, it kept ~80 more registers live with tensor-core rotations)
            if not EARLY_LOADS:
                off_c = tl.load(off_ptr + kvh * HEAD_D + offs_d)
            qc = tl.sum(q32 * off_c[None, :], 1)
        q = q32.to(tl.float16)
    else:
        q = tl.load(q_ptrs, mask=ok_x[:, None] & in_copy, other=0.0).to(tl.float16)
        if HAS_OFF:
            if not EARLY_LOADS:
                off_c = tl.load(off_ptr + kvh * HEAD_D + offs_d)
            qc = tl.sum(q.to(tl.float32) * off_c[None, :], 1)
    if FIRST_IN_MERGE and HAS_ROT:
        # the split merge attends the first tokens: split 0 stores its rotated query rows (fp32,
        # the score scale's sign not folded in) for it; without a rotation it reads the query
        qr_rows = (b.to(tl.int64) * Lq + t_x) * Hq + head_x
        tl.store(qr_ptr + qr_rows[:, None] * HEAD_D + offs_d[None, :], q32,
                 mask=ok_x[:, None] & (offs_d[None, :] < tl.where(split == 0, HEAD_D, 0)))  # fmt: skip
    n_first = 0
    if HAS_FIRST:
        # first tokens: keys kv0 .. kv0 + n_first - 1 come from the side buffer (first_split,
        # or the split merge)
        if not EARLY_LOADS:
            flen = tl.load(flen_ptr + b)
        n_first = tl.minimum(tl.minimum(flen, n_first_max), seq_len - kv0)
        n_first = tl.maximum(n_first, 0)

    # key range of this query block: [lo, hi)
    t_first = qb * QPB
    t_last = tl.minimum(t_first + QPB, q_len) - 1
    p_min = seq_len - q_len + t_first
    p_max = seq_len - q_len + t_last
    lo = kv0 + n_first
    if USE_WINDOW:
        lo = tl.maximum(lo, p_min - window + 1)
    hi = seq_len
    if CAUSAL:
        hi = tl.minimum(hi, p_max + 1)
    hi = tl.where(t_last >= t_first, hi, lo)
    hi = tl.maximum(hi, lo)
    # this split's share, in whole tiles aligned to multiples of BLOCK_N
    lo_al = lo - lo % BLOCK_N
    n_tiles = (hi - lo_al + BLOCK_N - 1) // BLOCK_N
    per_split = (n_tiles + num_splits - 1) // num_splits
    if SPLIT_FROM_END:
        # whole shares counted back from the last tile: split 0 takes the remainder (the
        # shortest share), and with it the masked tile after lo and the first tokens
        t_hi = n_tiles - (num_splits - 1 - split) * per_split
        s_lo = tl.minimum(lo_al + tl.maximum(t_hi - per_split, 0) * BLOCK_N, hi)
        s_hi = tl.maximum(tl.minimum(lo_al + t_hi * BLOCK_N, hi), s_lo)
    else:
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

    if FOLD:
        qk_scale = sm_scale
        v_mult = 1.0
    elif GROUP_SCALES:
        # tiles were dequantized with scales x 16 (fp16-normal down to amax ~1.7e-3)
        qk_scale = sm_scale * 0.0625
        v_mult = 0.0625
    else:
        if not EARLY_LOADS:
            k_mult = tl.load(ks_ptr + kvh * s_ks)
            v_mult = tl.load(vs_ptr + kvh * s_vs)
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
    k_base = k_ptr + kvh * s_kh
    v_base = v_ptr + kvh * s_vh
    kg_base = kg_ptr + kvh * s_kgh
    vg_base = vg_ptr + kvh * s_vgh

    m_i = tl.full([RB], float("-inf"), tl.float32)
    l_i = tl.zeros([RB], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    if HAS_FIRST and not FIRST_IN_MERGE:
        # the first tokens' keys start the online softmax (it is order-free), key by key
        row_stride = (Hq // GROUP) * HEAD_D
        if not EARLY_LOADS:
            first_off = (b.to(tl.int64) * n_first_max * (Hq // GROUP) + kvh) * HEAD_D
            fk0 = 0.0  # unused: each step loads its key
            fv0 = 0.0
        acc, m_i, l_i = _first_tokens(
            acc, m_i, l_i, q, tl.where(split == first_split, n_first, 0), kv0, seq_len, pos,
            p_min, p_max, window, qk_scale, softcap, k_mult, v_mult, fk_ptr + first_off,
            fv_ptr + first_off, row_stride, shift, fk0, fv0, CAUSAL, USE_WINDOW, USE_SOFTCAP,
            HEAD_D, EARLY_LOADS,
        )  # fmt: skip

    if USE_WHILE:
        n0 = s_lo
        while n0 < head_hi:
            acc, m_i, l_i = _attn_tile(
                acc, m_i, l_i, q, n0, lo, s_hi, pos, window, qk_scale, softcap, qcs,
                bt_row, k_base, v_base, kg_base, vg_base,
                s_kp, s_kt, s_kd, s_vp, s_vt, s_vd, s_kgp, s_kgt, s_vgp, s_vgt,
                True, CAUSAL, USE_WINDOW, USE_SOFTCAP, GROUP_SCALES, FOLD, NG, OFF_IN_TILE,
                RB, BLOCK_N, HEAD_D, PAGE, TP, V_RUNS_DENSE, SCALE_RUNS_DENSE,
            )  # fmt: skip
            n0 += BLOCK_N
        n0 = int_lo
        while n0 < mid:
            acc, m_i, l_i = _attn_tile(
                acc, m_i, l_i, q, n0, lo, s_hi, pos, window, qk_scale, softcap, qcs,
                bt_row, k_base, v_base, kg_base, vg_base,
                s_kp, s_kt, s_kd, s_vp, s_vt, s_vd, s_kgp, s_kgt, s_vgp, s_vgt,
                False, CAUSAL, USE_WINDOW, USE_SOFTCAP, GROUP_SCALES, FOLD, NG, OFF_IN_TILE,
                RB, BLOCK_N, HEAD_D, PAGE, TP, V_RUNS_DENSE, SCALE_RUNS_DENSE,
            )  # fmt: skip
            n0 += BLOCK_N
        while n0 < s_hi:
            acc, m_i, l_i = _attn_tile(
                acc, m_i, l_i, q, n0, lo, s_hi, pos, window, qk_scale, softcap, qcs,
                bt_row, k_base, v_base, kg_base, vg_base,
                s_kp, s_kt, s_kd, s_vp, s_vt, s_vd, s_kgp, s_kgt, s_vgp, s_vgt,
                True, CAUSAL, USE_WINDOW, USE_SOFTCAP, GROUP_SCALES, FOLD, NG, OFF_IN_TILE,
                RB, BLOCK_N, HEAD_D, PAGE, TP, V_RUNS_DENSE, SCALE_RUNS_DENSE,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in tl.range(s_lo, head_hi, BLOCK_N, num_stages=1):
            n0 = tl.multiple_of(n0, BLOCK_N)
            acc, m_i, l_i = _attn_tile(
                acc, m_i, l_i, q, n0, lo, s_hi, pos, window, qk_scale, softcap, qcs,
                bt_row, k_base, v_base, kg_base, vg_base,
                s_kp, s_kt, s_kd, s_vp, s_vt, s_vd, s_kgp, s_kgt, s_vgp, s_vgt,
                True, CAUSAL, USE_WINDOW, USE_SOFTCAP, GROUP_SCALES, FOLD, NG, OFF_IN_TILE,
                RB, BLOCK_N, HEAD_D, PAGE, TP, V_RUNS_DENSE, SCALE_RUNS_DENSE,
            )  # fmt: skip
        for n0 in tl.range(int_lo, mid, BLOCK_N, num_stages=LOOP_STAGES):
            n0 = tl.multiple_of(n0, BLOCK_N)
            acc, m_i, l_i = _attn_tile(
                acc, m_i, l_i, q, n0, lo, s_hi, pos, window, qk_scale, softcap, qcs,
                bt_row, k_base, v_base, kg_base, vg_base,
                s_kp, s_kt, s_kd, s_vp, s_vt, s_vd, s_kgp, s_kgt, s_vgp, s_vgt,
                False, CAUSAL, USE_WINDOW, USE_SOFTCAP, GROUP_SCALES, FOLD, NG, OFF_IN_TILE,
                RB, BLOCK_N, HEAD_D, PAGE, TP, V_RUNS_DENSE, SCALE_RUNS_DENSE,
            )  # fmt: skip
        for n0 in tl.range(mid, s_hi, BLOCK_N, num_stages=1):
            n0 = tl.multiple_of(n0, BLOCK_N)
            acc, m_i, l_i = _attn_tile(
                acc, m_i, l_i, q, n0, lo, s_hi, pos, window, qk_scale, softcap, qcs,
                bt_row, k_base, v_base, kg_base, vg_base,
                s_kp, s_kt, s_kd, s_vp, s_vt, s_vd, s_kgp, s_kgt, s_vgp, s_vgt,
                True, CAUSAL, USE_WINDOW, USE_SOFTCAP, GROUP_SCALES, FOLD, NG, OFF_IN_TILE,
                RB, BLOCK_N, HEAD_D, PAGE, TP, V_RUNS_DENSE, SCALE_RUNS_DENSE,
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
        tl.store(part_ptr + prow[:, None] * HEAD_D + offs_d[None, :], o, mask=row_in[:, None])
    else:
        o_ptrs = out_ptr + b.to(tl.int64) * s_ob + t[:, None] * s_ot + head[:, None] * s_oh
        o_ptrs += offs_d[None, :] * s_od
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_in[:, None])


@triton.jit
def _merge_row(
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
    qr_ptr,
    s_qrb,
    s_qrt,
    s_qrh,
    s_qrd,
    fk_ptr,
    fv_ptr,
    flen_ptr,
    n_first_max,
    seq_ptr,
    qlen_ptr,
    start_ptr,
    sm_scale,
    softcap,
    window,
    SPLITS_P2: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_FIRST: tl.constexpr,
    FIRST_P2: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_QLEN: tl.constexpr,
    HAS_START: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    """Merge the split partials of ``BLOCK_D`` columns of one output row (sequence, token, head).

    With ``HAS_FIRST`` the merge also attends the first tokens: their scores are the dots of
    the row's query in the pages' frame (``qr_ptr``: the rotated rows split 0 stored, or the
    query itself without a rotation) with ``first_k``, under the attention kernel's masks, and
    they join the partials' log-sum-exps as ``FIRST_P2`` more terms, their values ``first_v``
    as they are. Without it the first-token arguments are never read.
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
    if HAS_FIRST:
        seq_len = tl.load(seq_ptr + b)
        if HAS_QLEN:
            q_len = tl.minimum(tl.load(qlen_ptr + b), Lq)
        else:
            q_len = Lq
        if HAS_START:
            kv0 = tl.load(start_ptr + b)
        else:
            kv0 = 0
        flen = tl.load(flen_ptr + b)
        # the side buffer's rows of this (sequence, KV head), loaded up to its size (not up to
        # first_lens: every load of the merge is issued at once, none waits for another)
        offs_f = tl.arange(0, FIRST_P2)
        f_in = offs_f < n_first_max
        f_base = ((b.to(tl.int64) * n_first_max + offs_f) * (Hq // GROUP) + h // GROUP) * HEAD_D
        offs_k = tl.arange(0, HEAD_D)
        q_row = tl.load(qr_ptr + b.to(tl.int64) * s_qrb + t * s_qrt + h * s_qrh + offs_k * s_qrd)
        fk = tl.load(fk_ptr + f_base[:, None] + offs_k[None, :], mask=f_in[:, None], other=0.0)
        fv = tl.load(fv_ptr + f_base[:, None] + offs_d[None, :], mask=f_in[:, None], other=0.0)
        # key f at position kv0 + f, seen by the row's token at pos under the kernel's masks
        n_first = tl.minimum(tl.minimum(flen, n_first_max), seq_len - kv0)
        pos = seq_len - q_len + t
        key = kv0 + offs_f
        vis = (offs_f < n_first) & (t < q_len)
        if CAUSAL:
            vis = vis & (key <= pos)
        if USE_WINDOW:
            vis = vis & (key > pos - window)
        fs = tl.sum(fk.to(tl.float32) * q_row.to(tl.float32)[None, :], 1) * sm_scale
        if USE_SOFTCAP:
            e = tl.exp(2.0 * (fs / softcap))
            fs = softcap * (1.0 - 2.0 / (e + 1.0))
        fs = tl.where(vis, fs * 1.4426950408889634, float("-inf"))
        fv = tl.where(vis[:, None], fv.to(tl.float32), 0.0)  # unseen: out of the sum (0 * NaN)
        m = tl.maximum(m, tl.max(fs, 0))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_use)
    denom = tl.sum(w, 0)
    acc = tl.sum(w[:, None] * part, 0)
    if HAS_FIRST:
        wf = tl.exp2(fs - m_use)
        denom += tl.sum(wf, 0)
        acc += tl.sum(wf[:, None] * fv, 0)
    if HAS_SINKS:  # the sink's term of the denominator, once (no key at all: the output stays 0)
        sink = tl.load(sink_ptr + h) * 1.4426950408889634
        denom += tl.where(m == float("-inf"), 0.0, tl.exp2(sink - m_use))
    o = acc / tl.where(denom > 0.0, denom, 1.0)
    o_ptrs = out_ptr + b.to(tl.int64) * s_ob + t * s_ot + h * s_oh + offs_d * s_od
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty))


@specialize.jit(varying=("num_splits",), unaligned=("Lq",))
def _reduce_kernel(
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
    HAS_SINKS: tl.constexpr,
):
    """Merge the split partials of ``BLOCK_D`` columns of one output row (sequence, token, head)."""
    _merge_row(
        part_ptr, lse_ptr, out_ptr, Lq, Hq, num_splits, s_ob, s_ot, s_oh, s_od, sink_ptr,
        lse_ptr, 0, 0, 0, 0, lse_ptr, lse_ptr, lse_ptr, 0, lse_ptr, lse_ptr, lse_ptr, 1.0, 1.0, 0,
        SPLITS_P2, HEAD_D, BLOCK_D, PDL, HAS_SINKS, False, 2, 1, False, False, False, False, False,
    )  # fmt: skip


@specialize.jit(varying=("num_splits",), unaligned=("Lq",))
def _reduce_first_kernel(
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
    qr_ptr,
    s_qrb,
    s_qrt,
    s_qrh,
    s_qrd,
    fk_ptr,
    fv_ptr,
    flen_ptr,
    n_first_max,
    seq_ptr,
    qlen_ptr,
    start_ptr,
    sm_scale,
    softcap,
    window,
    SPLITS_P2: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    FIRST_P2: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_QLEN: tl.constexpr,
    HAS_START: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    """:func:`_reduce_kernel` that also attends the first tokens (``FIRST_SPLIT="merge"``).

    A kernel apart, so that the other formats' merge keeps its arguments (its launch cost).
    """
    _merge_row(
        part_ptr, lse_ptr, out_ptr, Lq, Hq, num_splits, s_ob, s_ot, s_oh, s_od, sink_ptr,
        qr_ptr, s_qrb, s_qrt, s_qrh, s_qrd, fk_ptr, fv_ptr, flen_ptr, n_first_max,
        seq_ptr, qlen_ptr, start_ptr, sm_scale, softcap, window,
        SPLITS_P2, HEAD_D, BLOCK_D, PDL, HAS_SINKS, True, FIRST_P2, GROUP, HAS_QLEN, HAS_START,
        CAUSAL, USE_SOFTCAP, USE_WINDOW,
    )  # fmt: skip

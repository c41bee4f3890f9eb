"""Pure-PyTorch reference of :func:`kvquant.kernels.paged_attention` (its specification).

It is also the CPU backend (``backend="torch"``) and works on the kernels' paged layout:
pages ``[num_pages, page_size, Hkv, D]`` FP8 (one tensor for K, one for V); int32 block
tables ``[B, max_pages]`` (logical page ``i`` of sequence ``b`` is ``block_tables[b, i]``);
int32 sequence lengths ``[B]``; static scales fp32 ``[]`` or ``[Hkv]``; group scales fp32
``[num_pages, page_size, Hkv, D // G]``, written with each token. With the static K transform
(static scales only) the query is rotated, ``q @ R``, against the logical key ``code * s_k +
c``, and the first tokens of each sequence may come from a full-precision side buffer
(``first_k = k @ R``, ``first_v``). No argument validation here.
"""

from __future__ import annotations

import torch

from kvquant.kernels.fp8 import dequantize_stored, gather_kv

__all__ = ["paged_attention_reference"]


def paged_attention_reference(
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_group_scales: torch.Tensor | None = None,
    v_group_scales: torch.Tensor | None = None,
    q_lens: torch.Tensor | None = None,
    kv_start: torch.Tensor | None = None,
    causal: bool = True,
    softcap: float = 0.0,
    window: int = 0,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_offset: torch.Tensor | None = None,
    k_rotation: torch.Tensor | None = None,
    first_k: torch.Tensor | None = None,
    first_v: torch.Tensor | None = None,
    first_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of new query tokens over the paged FP8 cache, in fp32.

    The ``Lq`` query tokens of sequence ``b`` are its newest tokens: query ``i``
    (valid when ``i < q_lens[b]``) sits at position ``seq_lens[b] - q_lens[b] + i``
    and its own K/V are already in the cache. Key ``j`` is visible to query
    position ``p`` when ``kv_start[b] <= j < seq_lens[b]``, and (if ``causal``)
    ``j <= p``, and (if ``window > 0``) ``j > p - window``.

    Args:
        query: ``[B, Lq, Hq, D]`` fp32, fp16 or bf16; ``Hq`` a multiple of ``Hkv``.
        k_pages: ``[num_pages, page_size, Hkv, D]`` FP8.
        v_pages: ``[num_pages, page_size, Hkv, D]`` FP8.
        block_tables: int32 ``[B, max_pages]``.
        seq_lens: int32 ``[B]``.
        sm_scale: softmax scale applied to ``q·k``.
        k_scale: fp32 ``[]`` or ``[Hkv]`` static scale, or None with group scales.
        v_scale: fp32 ``[]`` or ``[Hkv]`` static scale, or None with group scales.
        k_group_scales: fp32 ``[num_pages, page_size, Hkv, D // G]`` or None.
        v_group_scales: fp32 ``[num_pages, page_size, Hkv, D // G]`` or None.
        q_lens: int32 ``[B]`` valid query tokens per sequence (default ``Lq``).
        kv_start: int32 ``[B]`` first visible key per sequence (left padding; default 0).
        causal: mask keys after the query position.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
        window: if > 0, a query sees only the last ``window`` positions up to itself.
        out: optional ``[B, Lq, Hq, D]`` output in the query dtype.
        sinks: fp32 ``[Hq]`` learned attention-sink logits (gpt-oss), or None: each
            head's softmax gets one more term ``exp(sinks[h])`` in its denominator
            (a logit with no value), so the weights of the keys sum to less than 1.
        k_offset: fp32 ``[Hkv, D]`` K offset (rotated frame), or None: the logical key is
            ``code * k_scale + c``.
        k_rotation: fp32 ``[D, D]`` orthonormal K rotation, or None: the query is rotated
            alike (``q @ R``) before its scores.
        first_k: ``[B, NF, Hkv, D]`` float, the first tokens' keys in the rotated frame
            (``k @ R``, no offset), with ``first_v`` and ``first_lens``, or None.
        first_v: ``[B, NF, Hkv, D]`` float, their values.
        first_lens: int32 ``[B]``: keys ``kv_start[b] .. kv_start[b] + first_lens[b] - 1`` are
            taken from ``first_k[b, i]`` / ``first_v[b, i]`` instead of the pages (same
            visibility rules); their slots are never read.

    Returns:
        ``[B, Lq, Hq, D]`` in the query dtype. Rows of invalid queries, and rows
        that see no key, are zeros. A slot no query of the call can see
        (before ``kv_start``, behind every query's window) never reaches the
        output, whatever it holds.
    """
    bsz, lq, hq, d = query.shape
    hkv = k_pages.shape[2]
    group = hq // hkv
    result = torch.zeros(bsz, lq, hq, d, dtype=torch.float32, device=query.device)
    seq_cpu = seq_lens.tolist()
    qlen_cpu = q_lens.tolist() if q_lens is not None else [lq] * bsz
    start_cpu = kv_start.tolist() if kv_start is not None else [0] * bsz
    first_cpu = first_lens.tolist() if first_lens is not None else [0] * bsz
    for b in range(bsz):
        n, nq = int(seq_cpu[b]), int(qlen_cpu[b])
        if n == 0 or nq == 0:
            continue
        # gather this sequence's tokens first, then dequantize only those (K in the rotated
        # frame: code * s + c)
        k, v = (
            dequantize_stored(
                gather_kv(pages, block_tables, n, b),
                static,
                None if groups is None else gather_kv(groups, block_tables, n, b),
                offset,
            )
            for pages, static, groups, offset in (
                (k_pages, k_scale, k_group_scales, k_offset),
                (v_pages, v_scale, v_group_scales, None),
            )
        )  # [n, Hkv, D]
        nf = int(first_cpu[b])
        if nf and first_k is not None and first_v is not None:
            # the first tokens from the full-precision side buffer, not from their slots
            s0 = int(start_cpu[b])
            nf = max(0, min(nf, n - s0, first_k.shape[1]))
            k[s0 : s0 + nf] = first_k[b, :nf].float()
            v[s0 : s0 + nf] = first_v[b, :nf].float()
        k = k.repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[b, :nq].float()  # [nq, Hq, D]
        if k_rotation is not None:
            q = q @ k_rotation.float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        pos_q = torch.arange(n - nq, n, device=query.device)[:, None]
        pos_k = torch.arange(n, device=query.device)[None, :]
        visible = pos_k >= int(start_cpu[b])
        if causal:
            visible = visible & (pos_k <= pos_q)
        if window > 0:
            visible = visible & (pos_k > pos_q - window)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:  # softmax over [scores, sink], the sink's column dropped
            sink = sinks.float()[:, None, None].expand(-1, nq, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        # A row that sees no key is all -inf (softmax gives NaN): it outputs zeros. A NaN
        # stored in a visible key or value still propagates to the output.
        probs = torch.where(visible.any(dim=-1, keepdim=True), probs, 0.0)
        # A key no query of the call sees (before kv_start, behind every window) never reaches
        # the output, whatever its slot holds: 0 * NaN would be NaN. (A key that some query of
        # the call sees enters the product; a non-finite value there reaches the rows of
        # earlier queries through 0 * NaN, as in SDPA and the Triton kernels.)
        v = torch.where(visible.any(dim=0)[:, None, None], v, 0.0)
        result[b, :nq] = torch.einsum("hqk,khd->qhd", probs, v)
    if out is None:
        return result.to(query.dtype)
    out.copy_(result)
    return out

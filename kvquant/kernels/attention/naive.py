"""Pure-PyTorch reference of :func:`kvquant.kernels.paged_attention` (its specification).

It is also the CPU backend (``backend="torch"``) and works on the kernels' paged layout:
pages ``[num_pages, page_size, Hkv, D]`` FP8 (one tensor for K, one for V); int32 block
tables ``[B, max_pages]`` (logical page ``i`` of sequence ``b`` is ``block_tables[b, i]``);
int32 sequence lengths ``[B]``; the scale scheme (:mod:`kvquant.schemes`): static scales fp32
``[]`` or ``[Hkv]``, or group scales fp32 ``[num_pages, page_size, Hkv, D // G]`` written with
each token. A 4-bit side (:class:`~kvquant.schemes.Fp4Scales`) stores packed e2m1 codes
``uint8 [num_pages, page_size, Hkv, D // 2]`` with block scales beside them, dequantized by
:func:`kvquant.kernels.fp4.dequantize_fp4`. With the K transform the query is rotated,
``q @ R``, against the logical key ``code * s_k + c`` (4-bit K: its dequantized codes ``+ c``),
and the first tokens of each sequence may come from a full-precision side buffer
(``first.k = k @ R``, ``first.v``). No argument validation here.
"""

from __future__ import annotations

import torch

from kvquant.kernels.fp4 import dequantize_fp4
from kvquant.kernels.fp8 import dequantize_stored, gather_kv
from kvquant.schemes import (
    CAUSAL,
    FirstTokens,
    Fp4Format,
    KernelView,
    Mask,
    Pages,
    RecentTokens,
    Scheme,
)

__all__ = ["paged_attention_reference"]


def _sequence(
    pages: torch.Tensor,
    scales: torch.Tensor | None,
    static: torch.Tensor | None,
    fmt: Fp4Format | None,
    offset: torch.Tensor | None,
    block_tables: torch.Tensor,
    n: int,
    b: int,
) -> torch.Tensor:
    """fp32 ``[n, Hkv, D]``: sequence ``b``'s first ``n`` tokens of one side, gathered, then
    dequantized (FP8 ``code * s (+ c)``, or a 4-bit format's codes and block scales ``(+ c)``)."""
    codes = gather_kv(pages, block_tables, n, b)
    gathered = None if scales is None else gather_kv(scales, block_tables, n, b)
    if fmt is None:
        return dequantize_stored(codes, static, gathered, offset)
    x = dequantize_fp4(codes, gathered, fmt, static)  # type: ignore[arg-type]  # checked
    return x if offset is None else x + offset.float()


def paged_attention_reference(
    query: torch.Tensor,
    pages: Pages,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scheme: Scheme,
    *,
    sm_scale: float,
    mask: Mask = CAUSAL,
    first: FirstTokens | None = None,
    out: torch.Tensor | None = None,
    recent: RecentTokens | None = None,
) -> torch.Tensor:
    """Attention of new query tokens over the paged FP8 cache, in fp32.

    The ``Lq`` query tokens of sequence ``b`` are its newest tokens: query ``i``
    (valid when ``i < q_lens[b]``) sits at position ``seq_lens[b] - q_lens[b] + i``
    and its own K/V are already in the cache. Key ``j`` is visible to query
    position ``p`` when ``kv_start[b] <= j < seq_lens[b]``, and (if ``causal``)
    ``j <= p``, and (if ``window > 0``) ``j > p - window``.

    Args:
        query: ``[B, Lq, Hq, D]`` fp32, fp16 or bf16; ``Hq`` a multiple of ``Hkv``.
        pages: FP8 ``[num_pages, page_size, Hkv, D]`` K and V pages (with fp32
            ``[num_pages, page_size, Hkv, D // G]`` group scales for a dynamic scheme); a
            4-bit side: uint8 ``[num_pages, page_size, Hkv, D // 2]`` and its block scales.
        block_tables: int32 ``[B, max_pages]``.
        seq_lens: int32 ``[B]``.
        scheme: the pages' scale scheme; with a K transform the logical key is
            ``code * k_scale + k_offset`` and the query is rotated alike (``q @ R``).
        sm_scale: softmax scale applied to ``q·k``.
        mask: ``q_lens`` (default ``Lq``), ``kv_start`` (default 0), ``causal``, ``window``,
            ``softcap`` (if > 0, scores become ``softcap * tanh(scores / softcap)``) and
            ``sinks`` (fp32 ``[Hq]``: each head's softmax gets one more term ``exp(sinks[h])``
            in its denominator, a logit with no value).
        first: the first tokens' keys (rotated frame, no offset) and values, or None: keys
            ``kv_start[b] .. kv_start[b] + first.lens[b] - 1`` are taken from ``first.k[b, i]``
            / ``first.v[b, i]`` instead of the pages (same visibility rules); their slots are
            never read.
        out: optional ``[B, Lq, Hq, D]`` output in the query dtype.
        recent: each sequence's newest tokens at full precision, or None: keys
            ``max(kv_start[b], seq_lens[b] - R) .. seq_lens[b] - 1`` are taken from the ring
            (position ``p`` at ``recent.k[b, p % R]``), after the first tokens (same visibility
            rules).

    Returns:
        ``[B, Lq, Hq, D]`` in the query dtype. Rows of invalid queries, and rows
        that see no key, are zeros. A slot no query of the call can see
        (before ``kv_start``, behind every query's window) never reaches the
        output, whatever it holds.
    """
    view = scheme.kernel_view()
    bsz, lq, hq, d = query.shape
    group = hq // pages.k.shape[2]
    result = torch.zeros(bsz, lq, hq, d, dtype=torch.float32, device=query.device)
    seq_cpu = seq_lens.tolist()
    qlen_cpu = mask.q_lens.tolist() if mask.q_lens is not None else [lq] * bsz
    start_cpu = mask.kv_start.tolist() if mask.kv_start is not None else [0] * bsz
    first_cpu = first.lens.tolist() if first is not None else [0] * bsz
    for b in range(bsz):
        n, nq = int(seq_cpu[b]), int(qlen_cpu[b])
        if n == 0 or nq == 0:
            continue
        start = int(start_cpu[b])
        k, v = _keys_values(pages, view, block_tables, b, n, first, start, int(first_cpu[b]))
        if recent is not None:
            _overlay_recent(k, v, recent, b, n, start)
        k = k.repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[b, :nq].float()  # [nq, Hq, D]
        if view.k_rotation is not None:
            q = q @ view.k_rotation.float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
        if mask.softcap > 0:
            scores = mask.softcap * torch.tanh(scores / mask.softcap)
        visible = _visible(mask, n, nq, start, query.device)
        probs = _probabilities(scores, visible, mask.sinks)
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


def _keys_values(
    pages: Pages,
    view: KernelView,
    block_tables: torch.Tensor,
    b: int,
    n: int,
    first: FirstTokens | None,
    start: int,
    nf: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[n, Hkv, D]`` keys (rotated frame: ``code * s + c``) and values of sequence ``b``.

    Gathers this sequence's tokens first, then dequantizes only those; the first tokens
    (``nf`` keys from key ``start`` on) come from the full-precision side buffer, not from
    their slots.
    """
    k, v = (
        _sequence(x, scales, static, fmt, offset, block_tables, n, b)
        for x, scales, static, fmt, offset in (
            (pages.k, pages.k_scales, view.k_scale, view.k_fp4, view.k_offset),
            (pages.v, pages.v_scales, view.v_scale, view.v_fp4, None),
        )
    )
    if nf and first is not None:
        nf = max(0, min(nf, n - start, first.k.shape[1]))
        k[start : start + nf] = first.k[b, :nf].float()
        v[start : start + nf] = first.v[b, :nf].float()
    return k, v


def _overlay_recent(
    k: torch.Tensor, v: torch.Tensor, recent: RecentTokens, b: int, n: int, start: int
) -> None:
    """Keys and values ``max(start, n - R) .. n - 1`` of sequence ``b`` from the ring, in place
    (``k`` in the pages' frame with the offset added back, as the ring holds it)."""
    ring = recent.k.shape[1]
    pos = torch.arange(max(start, n - ring), n, device=k.device)
    slots = (pos % ring).to(recent.kv.device)
    k[pos] = recent.k[b, slots].to(device=k.device, dtype=torch.float32)
    v[pos] = recent.v[b, slots].to(device=v.device, dtype=torch.float32)


def _visible(mask: Mask, n: int, nq: int, start: int, device: torch.device) -> torch.Tensor:
    """bool ``[nq, n]``: which of a sequence's ``n`` keys each of its ``nq`` newest queries sees."""
    pos_q = torch.arange(n - nq, n, device=device)[:, None]
    pos_k = torch.arange(n, device=device)[None, :]
    visible = pos_k >= start
    if mask.causal:
        visible = visible & (pos_k <= pos_q)
    if mask.window > 0:
        visible = visible & (pos_k > pos_q - mask.window)
    return visible


def _probabilities(
    scores: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor | None
) -> torch.Tensor:
    """Softmax ``[Hq, nq, n]`` of the visible ``scores`` (with each head's sink term, if any).

    A row that sees no key is all -inf (softmax gives NaN): it gets zeros. A NaN stored in a
    visible key or value still propagates to the output.
    """
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # softmax over [scores, sink], the sink's column dropped
        sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.where(visible.any(dim=-1, keepdim=True), probs, 0.0)

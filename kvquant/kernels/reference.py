"""Pure-PyTorch reference of kvquant's paged FP8 KV cache operations.

This module is the semantic specification of the kernels and doubles as the
CPU backend (``backend="torch"``). It works on exactly the same paged layout as
the Triton kernels:

* pages: ``[num_pages, page_size, kv_heads, head_dim]`` in ``float8_e4m3fn``
  (or ``float8_e5m2``), one tensor for K and one for V;
* block tables: ``int32 [batch, max_pages]``, logical page ``i`` of sequence
  ``b`` is physical page ``block_tables[b, i]``;
* sequence lengths: ``int32 [batch]``, tokens stored for each sequence;
* static scales: fp32 ``[]`` (per-tensor) or ``[kv_heads]`` (per-head);
* group scales: fp32 ``[num_pages, page_size, kv_heads, head_dim // G]``, one
  per token, KV head and group of ``G`` head_dim elements, written with the token.

A scale is a dequantization multiplier: ``x ≈ float(code) * scale``.
Values are clamped to the format's finite range before every cast; non-finite
inputs are stored as NaN so that they surface in the attention output instead
of being silently clipped.

The functions here do no argument validation: the public entry points in
:mod:`kvquant.kernels` validate before dispatching.
"""

from __future__ import annotations

import torch

__all__ = [
    "dequantize_pages",
    "fp8_max",
    "gather_kv",
    "paged_attention_reference",
    "quantize_fp8",
    "write_kv_reference",
]


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Quantize ``x / scale`` to ``dtype`` with saturation; non-finite inputs become NaN.

    Args:
        x: values of any float dtype.
        scale: fp32 dequantization multipliers, broadcastable to ``x``.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Returns:
        FP8 codes with the shape of ``x``.
    """
    limit = fp8_max(dtype)
    y = x.float() / scale
    y = torch.where(torch.isfinite(x.float()), y.clamp(-limit, limit), torch.nan)
    return y.to(dtype)


def _group_scales(x: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """fp32 group scales ``amax / fp8_max`` of ``x [..., D]`` → ``[..., D // group_size]``.

    An all-zero group gets scale 1.0 (any positive scale encodes zeros exactly);
    a group holding a non-finite value gets NaN.
    """
    xg = x.float().unflatten(-1, (-1, group_size))
    amax = xg.abs().amax(dim=-1)
    # Divide by a tensor, not a Python number: CUDA turns division by a CPU scalar into a
    # multiplication by its reciprocal, which rounds differently from the CPU (and the kernels).
    scale = amax / torch.full_like(amax, fp8_max(dtype))
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    finite = torch.isfinite(xg).all(dim=-1)
    return torch.where(finite, scale, torch.nan)


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_group_scales: torch.Tensor | None = None,
    v_group_scales: torch.Tensor | None = None,
) -> None:
    """Quantize new K/V tokens and store them into their page slots (in place).

    Args:
        key: ``[B, L, Hkv, D]`` fp32, fp16 or bf16 (any strides).
        value: ``[B, L, Hkv, D]``, any float dtype (may differ from ``key``).
        k_pages: ``[num_pages, page_size, Hkv, D]`` FP8, written in place.
        v_pages: ``[num_pages, page_size, Hkv, D]`` FP8, written in place.
        slot_mapping: int64 ``[B, L]``; slot ``page * page_size + offset``; a
            negative slot means "do not store this token".
        k_scale: fp32 ``[]`` or ``[Hkv]`` static scale (with ``v_scale``).
        v_scale: fp32 ``[]`` or ``[Hkv]`` static scale.
        k_group_scales: fp32 ``[num_pages, page_size, Hkv, D // G]`` written in
            place (dynamic ``fp32-group`` format, with ``v_group_scales``).
        v_group_scales: like ``k_group_scales``.
    """
    _, page_size, hkv, d = k_pages.shape
    slots = slot_mapping.reshape(-1)
    keep = slots >= 0
    slots = slots[keep]
    page, off = slots // page_size, slots % page_size
    for x, pages, static, groups in (
        (key, k_pages, k_scale, k_group_scales),
        (value, v_pages, v_scale, v_group_scales),
    ):
        xs = x.reshape(-1, hkv, d)[keep]
        if groups is not None:
            g = d // groups.shape[-1]
            sc = _group_scales(xs, g, pages.dtype)  # [N, Hkv, D/G]
            codes = quantize_fp8(xs, sc.repeat_interleave(g, dim=-1), pages.dtype)
            groups[page, off] = sc
        else:
            if static is None:
                raise ValueError("write_kv_reference needs static scales or group scales")
            sc = static.float().reshape(-1, 1) if static.dim() else static.float()
            codes = quantize_fp8(xs, sc, pages.dtype)
        pages[page, off] = codes


def dequantize_pages(
    pages: torch.Tensor,
    static_scale: torch.Tensor | None,
    group_scales: torch.Tensor | None,
) -> torch.Tensor:
    """Dequantize FP8 codes (whole pages, or tokens gathered from them) to fp32.

    Args:
        pages: ``[..., Hkv, D]`` FP8, e.g. ``[num_pages, page_size, Hkv, D]``.
        static_scale: fp32 ``[]`` or ``[Hkv]``, or None when ``group_scales`` is given.
        group_scales: fp32 ``[..., Hkv, D // G]`` (the same leading dims) or None.

    Returns:
        fp32 tensor of the shape of ``pages``.
    """
    x = pages.float()
    if group_scales is not None:
        g = x.shape[-1] // group_scales.shape[-1]
        return x * group_scales.repeat_interleave(g, dim=-1)
    if static_scale is None:
        raise ValueError("dequantize_pages needs a static scale or group scales")
    s = static_scale.float()
    return x * (s.reshape(-1, 1) if s.dim() else s)


def gather_kv(
    pages: torch.Tensor, block_tables: torch.Tensor, seq_len: int, batch_index: int
) -> torch.Tensor:
    """Gather the first ``seq_len`` tokens of sequence ``batch_index``.

    Works on pages ``[num_pages, page_size, Hkv, D]`` and on group scales
    ``[num_pages, page_size, Hkv, D // G]`` alike: returns ``[seq_len, Hkv, ...]``.
    """
    page_size = pages.shape[1]
    n_pages = (seq_len + page_size - 1) // page_size
    ids = block_tables[batch_index, :n_pages].long()
    return pages[ids].reshape(-1, *pages.shape[2:])[:seq_len]


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
    for b in range(bsz):
        n, nq = int(seq_cpu[b]), int(qlen_cpu[b])
        if n == 0 or nq == 0:
            continue
        # gather this sequence's tokens first, then dequantize only those
        k, v = (
            dequantize_pages(
                gather_kv(pages, block_tables, n, b),
                static,
                None if groups is None else gather_kv(groups, block_tables, n, b),
            ).repeat_interleave(group, dim=1)  # [n, Hq, D]
            for pages, static, groups in (
                (k_pages, k_scale, k_group_scales),
                (v_pages, v_scale, v_group_scales),
            )
        )
        q = query[b, :nq].float()  # [nq, Hq, D]
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

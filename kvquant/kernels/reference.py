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
  per token, KV head and group of ``G`` head_dim elements, written with the token;
* the static K transform (``k-transform``, with static scales only): an fp32 offset
  ``c [kv_heads, head_dim]`` and an optional orthonormal rotation ``R [head_dim, head_dim]``
  (``None`` = identity, e.g. :func:`hadamard`). K is stored as
  ``fp8((k @ R - c) / s_k)``; the attention uses the rotated query ``q @ R`` against the
  logical key ``code * s_k + c`` (``q·k`` up to FP8 rounding, since ``R R^T = I``). The first
  tokens of each sequence may be attended from a full-precision side buffer instead of the
  pages (``first_k`` in the rotated frame, ``k @ R``; ``first_v`` as the model produced it).

A scale is a dequantization multiplier: ``x ≈ float(code) * scale``.
Values are clamped to the format's finite range before every cast; non-finite
inputs are stored as NaN so that they surface in the attention output instead
of being silently clipped.

The functions here do no argument validation: the public entry points in
:mod:`kvquant.kernels` validate before dispatching.
"""

from __future__ import annotations

import torch

from kvquant.errors import KernelInputError

__all__ = [
    "dequantize_pages",
    "fp8_max",
    "gather_kv",
    "hadamard",
    "paged_attention_reference",
    "quantize_fp8",
    "write_kv_reference",
]


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def hadamard(
    dim: int, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix ``H [dim, dim]`` (symmetric, ``H @ H = I``).

    ``H[i, j] = (-1) ** popcount(i & j) / sqrt(dim)``: the built-in rotation of the
    ``k-transform`` format (``k_rotation=hadamard(head_dim)``).

    Args:
        dim: the matrix size (a head_dim), a power of two >= 1.
        device: where to allocate.
        dtype: a floating dtype (fp32 for the kernels).

    Returns:
        The ``[dim, dim]`` matrix.

    Raises:
        KernelInputError: ``dim`` is not a power of two.

    Example:
        >>> import torch
        >>> h = hadamard(4)
        >>> bool(torch.allclose(h @ h, torch.eye(4)))
        True
    """
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1 or dim & (dim - 1):
        raise KernelInputError(
            f"hadamard: dim is {dim!r}; the Hadamard rotation needs a power-of-two head_dim "
            "(Sylvester's construction). Fix: use rotation=None (offset only) for this model."
        )
    idx = torch.arange(dim)
    bits = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    signs = 1.0 - 2.0 * parity.to(torch.float64)
    return (signs / dim**0.5).to(dtype=dtype, device=device)


def transform_keys(
    key: torch.Tensor, k_offset: torch.Tensor | None, k_rotation: torch.Tensor | None
) -> torch.Tensor:
    """``key @ R - c`` in fp32: the model-frame keys ``[..., Hkv, D]`` as the pages store them.

    Args:
        key: ``[..., Hkv, D]`` any float dtype.
        k_offset: fp32 ``[Hkv, D]`` (rotated frame) or None (zeros).
        k_rotation: fp32 ``[D, D]`` orthonormal or None (identity).

    Returns:
        fp32 tensor of the shape of ``key``.
    """
    x = key.float()
    if k_rotation is not None:
        x = x @ k_rotation.float()
    if k_offset is not None:
        x = x - k_offset.float()
    return x


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
    k_offset: torch.Tensor | None = None,
    k_rotation: torch.Tensor | None = None,
) -> None:
    """Quantize new K/V tokens and store them into their page slots (in place).

    With a K transform (``k_offset`` and/or ``k_rotation``, static scales only), K is
    stored as ``fp8((key @ R - c) / k_scale)``; V is stored as without it.

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
        k_offset: fp32 ``[Hkv, D]`` K offset (rotated frame), or None (zeros).
        k_rotation: fp32 ``[D, D]`` orthonormal K rotation, or None (identity).
    """
    _, page_size, hkv, d = k_pages.shape
    slots = slot_mapping.reshape(-1)
    keep = slots >= 0
    slots = slots[keep]
    page, off = slots // page_size, slots % page_size
    transformed = k_offset is not None or k_rotation is not None
    for x, pages, static, groups in (
        (key, k_pages, k_scale, k_group_scales),
        (value, v_pages, v_scale, v_group_scales),
    ):
        xs = x.reshape(-1, hkv, d)[keep]
        if transformed and pages is k_pages:
            xs = transform_keys(xs, k_offset, k_rotation)
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
    *,
    k_offset: torch.Tensor | None = None,
    k_rotation: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize FP8 codes (whole pages, or tokens gathered from them) to fp32.

    With a K transform the result is in the model's frame, ``(code * s + c) @ R^T``, so
    that it compares with the unpatched model's K.

    Args:
        pages: ``[..., Hkv, D]`` FP8, e.g. ``[num_pages, page_size, Hkv, D]``.
        static_scale: fp32 ``[]`` or ``[Hkv]``, or None when ``group_scales`` is given.
        group_scales: fp32 ``[..., Hkv, D // G]`` (the same leading dims) or None.
        k_offset: fp32 ``[Hkv, D]`` K offset (rotated frame) of K pages, or None.
        k_rotation: fp32 ``[D, D]`` K rotation of K pages, or None.

    Returns:
        fp32 tensor of the shape of ``pages``.
    """
    x = _dequantize_rotated(pages, static_scale, group_scales, k_offset)
    if k_rotation is not None:
        x = x @ k_rotation.float().T
    return x


def _dequantize_rotated(
    pages: torch.Tensor,
    static_scale: torch.Tensor | None,
    group_scales: torch.Tensor | None,
    k_offset: torch.Tensor | None,
) -> torch.Tensor:
    """``code * scale (+ c)``: the logical values in the frame the pages store (K rotated)."""
    x = pages.float()
    if group_scales is not None:
        g = x.shape[-1] // group_scales.shape[-1]
        return x * group_scales.repeat_interleave(g, dim=-1)
    if static_scale is None:
        raise ValueError("dequantize_pages needs a static scale or group scales")
    s = static_scale.float()
    x = x * (s.reshape(-1, 1) if s.dim() else s)
    if k_offset is not None:
        x = x + k_offset.float()
    return x


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
            _dequantize_rotated(
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
            nf = max(0, min(nf, n - s0))
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

"""Pure-PyTorch reference of :func:`kvquant.kernels.write_kv` (the write's specification).

It is also the CPU backend (``backend="torch"``) and works on the kernels' paged layout
(:mod:`kvquant.kernels.attention.naive` describes it). No argument validation here.
"""

from __future__ import annotations

import torch

from kvquant.errors import KernelInputError
from kvquant.kernels.fp8 import fp8_max, quantize_fp8, transform_keys
from kvquant.schemes import Pages, RecentTokens, Scheme

__all__ = ["ring_copy", "write_kv_reference", "write_recent_reference"]


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
    pages: Pages,
    slot_mapping: torch.Tensor,
    scheme: Scheme,
) -> None:
    """Quantize new K/V tokens and store them into their page slots (in place).

    Static schemes divide by their fp32 ``[]`` / ``[Hkv]`` scales; a dynamic one
    (:class:`~kvquant.schemes.GroupScales`) computes one scale per (token, KV head, group) and
    stores it in ``pages.k_scales`` / ``pages.v_scales``. With a K transform
    (:class:`~kvquant.schemes.KTransformScales`) K is stored as ``fp8((key @ R - c) /
    k_scale)``; V is stored as without it.

    Args:
        key: ``[B, L, Hkv, D]`` fp32, fp16 or bf16 (any strides).
        value: ``[B, L, Hkv, D]``, any float dtype (may differ from ``key``).
        pages: FP8 ``[num_pages, page_size, Hkv, D]`` K and V pages (and group scales
            ``[num_pages, page_size, Hkv, D // G]``), written in place.
        slot_mapping: int64 ``[B, L]``; slot ``page * page_size + offset``; a
            negative slot means "do not store this token".
        scheme: the pages' scale scheme.
    """
    view = scheme.kernel_view()
    _, page_size, hkv, d = pages.k.shape
    slots = slot_mapping.reshape(-1)
    keep = slots >= 0
    slots = slots[keep]
    page, off = slots // page_size, slots % page_size
    transformed = view.k_offset is not None or view.k_rotation is not None
    for x, codes_out, static, groups in (
        (key, pages.k, view.k_scale, pages.k_scales),
        (value, pages.v, view.v_scale, pages.v_scales),
    ):
        xs = x.reshape(-1, hkv, d)[keep]
        if transformed and codes_out is pages.k:
            xs = transform_keys(xs, view.k_offset, view.k_rotation)
        if view.group_size is not None and groups is not None:
            g = view.group_size
            sc = _group_scales(xs, g, codes_out.dtype)  # [N, Hkv, D/G]
            codes = quantize_fp8(xs, sc.repeat_interleave(g, dim=-1), codes_out.dtype)
            groups[page, off] = sc
        elif static is not None:
            sc = static.float().reshape(-1, 1) if static.dim() else static.float()
            codes = quantize_fp8(xs, sc, codes_out.dtype)
        else:
            raise KernelInputError(
                f"write_kv_reference: the {scheme.name!r} scheme has no static scales and "
                "pages has no group scales; expected one or the other. Fix: call "
                "kvquant.kernels.write_kv, which validates its arguments."
            )
        codes_out[page, off] = codes


def ring_copy(
    ring: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    rotation: torch.Tensor | None,
) -> None:
    """Tokens ``[B, L, Hkv, D]`` into slots ``slots`` (int64 ``[L]``, distinct) of ``ring``
    ``[B, 2, R, Hkv, D]``, in place, in the ring's dtype; keys rotated by ``rotation`` (fp32
    ``[D, D]``) if given. No value is read on the host (a CUDA graph captures it)."""
    if rotation is not None:
        key = key.float() @ rotation.float()
    ring[:, 0].index_copy_(1, slots, key.to(device=ring.device, dtype=ring.dtype))
    ring[:, 1].index_copy_(1, slots, value.to(device=ring.device, dtype=ring.dtype))


def write_recent_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    scheme: Scheme,
    recent: RecentTokens,
    recent_start: torch.Tensor,
) -> None:
    """Copy the new tokens into the ring of the newest tokens (in place), as
    :func:`kvquant.kernels.write_kv` does with ``recent``.

    Token ``l`` of sequence ``b`` sits at position ``recent_start + l`` and goes to slot
    ``(recent_start + l) % R`` of ``recent.kv[b]``: its key in the pages' frame before any
    offset (``key @ k_rotation`` for a scheme that rotates K), its value as given, both in the
    ring's dtype; every token, whatever its slot in the pages (a negative one skips only the
    pages). No value is read on the host (a CUDA graph captures it): for a decode step's one
    token, three small kernels.

    Args:
        key: ``[B, L, Hkv, D]`` (``L <= R``).
        value: ``[B, L, Hkv, D]``.
        scheme: the pages' scale scheme (its K rotation, if any).
        recent: the ring ``[B, 2, R, Hkv, D]``.
        recent_start: int64 ``[1]``, the position of every sequence's first new token.
    """
    ring = recent.kv
    seq = int(key.shape[1])
    pos = recent_start if seq == 1 else recent_start + torch.arange(seq, device=ring.device)
    slots = torch.remainder(pos, ring.shape[2])  # distinct: L <= R
    ring_copy(ring, key, value, slots, scheme.kernel_view().k_rotation)

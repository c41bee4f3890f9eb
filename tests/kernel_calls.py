"""Kernel calls from a test's loose tensors: the Pages, scheme, Mask and FirstTokens they make.

Kernel tests describe a problem as named tensors (``k_pages``, ``k_scale``, ``q_lens``...);
:func:`attention` and :func:`write` build the objects the kernel entry points take from them
(the scheme from which scales are given: group scales, a K transform, per-head or
per-tensor scales) and call ``fn`` (the entry point, its reference or its Triton launcher).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvquant.schemes import (
    FirstTokens,
    GroupScales,
    KTransformScales,
    Mask,
    Pages,
    PerHeadScales,
    PerTensorScales,
    Scheme,
)

__all__ = ["attention", "bound_attention", "make_scheme", "split", "write"]

_SCHEME_KEYS = ("k_scale", "v_scale", "k_group_scales", "v_group_scales", "k_offset", "k_rotation")
_MASK_KEYS = ("causal", "window", "softcap", "kv_start", "q_lens", "sinks")
_FIRST_KEYS = ("first_k", "first_v", "first_lens")


def make_scheme(
    num_kv_heads: int,
    head_dim: int,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_group_scales: torch.Tensor | None = None,
    v_group_scales: torch.Tensor | None = None,
    k_offset: torch.Tensor | None = None,
    k_rotation: torch.Tensor | None = None,
    first_tokens: int = 0,
) -> Scheme:
    """The scheme the given scales describe (a scalar scale beside a per-head one is broadcast).

    Static scales win over group scales given with them (which stay in the Pages: the
    kernels then refuse the mix).
    """
    if (
        k_scale is None
        and v_scale is None
        and (k_group_scales is not None or v_group_scales is not None)
    ):
        groups = (k_group_scales if k_group_scales is not None else v_group_scales).shape[-1]  # type: ignore[union-attr]
        if groups < 1 or head_dim % groups:  # no such scheme: the kernels refuse the pages
            return GroupScales.for_head_dim(head_dim)
        return GroupScales(head_dim=head_dim, group_size=head_dim // groups)
    if (
        isinstance(k_scale, torch.Tensor)
        and isinstance(v_scale, torch.Tensor)
        and k_scale.dim() != v_scale.dim()
    ):
        k_scale, v_scale = (
            s.expand(num_kv_heads).clone() if s.dim() == 0 else s for s in (k_scale, v_scale)
        )
    if k_offset is not None or k_rotation is not None or first_tokens:
        return KTransformScales(k_scale, v_scale, k_offset, k_rotation, first_tokens)
    if isinstance(k_scale, torch.Tensor) and k_scale.dim():
        return PerHeadScales(k_scale, v_scale)  # type: ignore[arg-type]
    return PerTensorScales(k_scale, v_scale)  # type: ignore[arg-type]


def split(kw: dict[str, Any], k_pages: torch.Tensor, v_pages: torch.Tensor) -> tuple[Pages, Scheme]:
    """Pop the scheme's tensors from ``kw``; return the Pages and the scheme.

    ``unchecked=True`` in ``kw``: the scheme holds the static scales as given, unchecked
    (negative scales, for the launchers, which take any sign).
    """
    scales = {k: kw.pop(k) for k in _SCHEME_KEYS if k in kw}
    pages = Pages(k_pages, v_pages, scales.get("k_group_scales"), scales.get("v_group_scales"))
    hkv, d = int(k_pages.shape[2]), int(k_pages.shape[3])
    if not kw.pop("unchecked", False):
        return pages, make_scheme(hkv, d, **scales)
    positive = {k: (v.abs() if k.endswith("_scale") else v) for k, v in scales.items()}
    name, ints, tensors = make_scheme(hkv, d, **positive).flatten()
    tensors[:2] = [scales["k_scale"], scales["v_scale"]]
    return pages, Scheme.unflatten(name, ints, tensors)


def write(
    fn: Callable[..., Any],
    key: torch.Tensor,
    value: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slot_mapping: torch.Tensor,
    **kw: Any,
) -> Any:
    """``fn(key, value, pages, slot_mapping, scheme, **rest)`` (``write_kv`` or its reference)."""
    pages, scheme = split(kw, k_pages, v_pages)
    return fn(key, value, pages, slot_mapping, scheme, **kw)


def bound_attention(
    fn: Callable[..., Any],
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    **kw: Any,
) -> Callable[[], Any]:
    """:func:`attention`'s call with its objects built now: for a CUDA graph's capture, where a
    scheme cannot be built (building one reads its scales on the host), only launched."""
    pages, scheme = split(kw, k_pages, v_pages)
    mask = Mask(**{k: kw.pop(k) for k in _MASK_KEYS if k in kw})
    first_parts = [kw.pop(k, None) for k in _FIRST_KEYS]
    first = None if first_parts[0] is None else FirstTokens(*first_parts)
    sm_scale = kw.pop("sm_scale")
    return lambda: fn(
        query, pages, block_tables, seq_lens, scheme, sm_scale=sm_scale, mask=mask, first=first,
        **kw,
    )  # fmt: skip


def attention(
    fn: Callable[..., Any],
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    **kw: Any,
) -> Any:
    """``fn(query, pages, block_tables, seq_lens, scheme, sm_scale=, mask=, first=, **rest)``."""
    pages, scheme = split(kw, k_pages, v_pages)
    mask = Mask(**{k: kw.pop(k) for k in _MASK_KEYS if k in kw})
    first_parts = [kw.pop(k, None) for k in _FIRST_KEYS]
    first = None if first_parts[0] is None else FirstTokens(*first_parts)
    if sm_scale is None:
        sm_scale = kw.pop("sm_scale")
    return fn(
        query,
        pages,
        block_tables,
        seq_lens,
        scheme,
        sm_scale=sm_scale,
        mask=mask,
        first=first,
        **kw,
    )

"""Builders of paged FP8 KV-cache problems for the attention kernel tests.

A case is random K/V written into shuffled pages with
:func:`kvquant.kernels.write_kv_reference` (the spec), every slot
nobody wrote poisoned with NaN codes (so a kernel reading past a sequence's
end or through an unused block-table entry produces NaN), and unused
block-table entries set to -1.

With ``k_transform`` (``"offset"``, ``"rotation"`` or ``"both"``; ``"biased"`` for the same
K stored without a transform) K gets a few large,
near-constant channels (the RoPE bias the ``k-transform`` format removes) and is written
with a per-(KV head, channel) offset (the mean of the rotated K) and/or the Hadamard
rotation; ``n_first`` / ``first_lens`` add the first-token side buffer (``first_k`` in the
rotated frame, ``first_v`` as generated; the first tokens' own slots are poisoned with NaN
codes, since the attention must never read them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvquant.kernels import (
    group_scale_storage,
    hadamard,
    page_storage,
    paged_attention_reference,
    write_kv_reference,
)
from kvquant.kernels.fp8 import fp8_max
from kvquant.schemes import (
    CAUSAL,
    FirstTokens,
    GroupScales,
    KTransformScales,
    Mask,
    Pages,
    PerHeadScales,
    PerTensorScales,
    Scheme,
)

__all__ = ["PagedCase", "build_case", "negate_k_scale"]


@dataclass
class PagedCase:
    """One attention problem: the query and the objects ``paged_attention`` takes."""

    query: torch.Tensor
    pages: Pages
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scheme: Scheme
    sm_scale: float
    mask: Mask = CAUSAL
    first: FirstTokens | None = None
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None

    def attend(self, fn: Callable[..., torch.Tensor], **kw: Any) -> torch.Tensor:
        """``fn(query, pages, block_tables, seq_lens, scheme, sm_scale=, mask=, first=, **kw)``:
        ``paged_attention``, its reference or its Triton launcher on the case (``kw`` may
        replace the case's ``sm_scale``, ``mask`` or ``first``)."""
        options = {"sm_scale": self.sm_scale, "mask": self.mask, "first": self.first, **kw}
        return fn(self.query, self.pages, self.block_tables, self.seq_lens, self.scheme, **options)

    def reference(self) -> torch.Tensor:
        """fp32 attention over the dequantized cache ``[B, Lq, Hq, D]``."""
        return paged_attention_reference(
            self.query.float(), self.pages, self.block_tables, self.seq_lens, self.scheme,
            sm_scale=self.sm_scale, mask=self.mask, first=self.first,
        )  # fmt: skip


def shuffled_pages(
    lens: list[int], page: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Block tables over shuffled pages for sequences of ``lens`` tokens.

    Two pages more than the sequences need (never in a table), one unused entry per row
    (-1), and the slot of each written token (-1 past a sequence's end).

    Returns:
        ``(block_tables int32 [B, max pages + 1], slots int64 [B, max(lens, 1)], num_pages)``.
    """
    bsz, lmax = len(lens), max(max(lens), 1)
    n_pages = [(n + page - 1) // page for n in lens]
    num_pages = sum(n_pages) + 2
    perm = torch.randperm(num_pages, generator=gen)
    block_tables = torch.full((bsz, max(n_pages) + 1), -1, dtype=torch.int32)
    slots = torch.full((bsz, lmax), -1, dtype=torch.int64)
    cursor = 0
    for b, (n, np_) in enumerate(zip(lens, n_pages, strict=True)):
        block_tables[b, :np_] = perm[cursor : cursor + np_].to(torch.int32)
        cursor += np_
        pos = torch.arange(n)
        slots[b, :n] = block_tables[b, pos // page].long() * page + pos % page
    return block_tables, slots, num_pages


def negate_k_scale(scheme: Scheme, head: int) -> Scheme:
    """``scheme`` (static, per-head) with KV head ``head``'s K scale negated, not checked.

    No scheme admits a negative scale when built; the kernels take the scale's sign as given
    (:meth:`Scheme.unflatten` does not check again).
    """
    name, ints, tensors = scheme.flatten()
    k_scale = tensors[0]
    assert k_scale is not None and k_scale.dim() == 1, scheme
    k_scale = k_scale.clone()
    k_scale[head] *= -1.0
    return Scheme.unflatten(name, ints, [k_scale, *tensors[1:]])


def build_case(
    lens: list[int],
    *,
    hq: int,
    hkv: int,
    d: int,
    page: int = 16,
    lq: int = 1,
    q_lens: list[int] | None = None,
    kv_start: list[int] | None = None,
    granularity: str = "per-tensor",
    group_size: int = 64,
    qdtype: torch.dtype = torch.float16,
    fp8: torch.dtype = torch.float8_e4m3fn,
    hf_layout: bool = False,
    causal: bool = True,
    softcap: float = 0.0,
    window: int = 0,
    value_gain: float = 1.0,
    contiguous_pages: bool = False,
    k_transform: str | None = None,
    first_lens: list[int] | None = None,
    n_first: int = 0,
    first_dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> PagedCase:
    """Random paged problem.

    Args:
        lens: tokens in the cache per sequence (the ``Lq`` new ones included).
        hq: query heads.
        hkv: KV heads.
        d: head dim.
        page: page size.
        lq: query tokens per sequence (tensor dimension).
        q_lens: valid query tokens per sequence, or None.
        kv_start: first visible key per sequence, or None.
        granularity: "per-tensor", "per-head" or "fp32-group".
        group_size: ``G`` for "fp32-group".
        qdtype: query dtype.
        fp8: page dtype.
        hf_layout: query as HF gives it, ``[B, Hq, Lq, D].transpose(1, 2)``.
        causal: causal masking.
        softcap: score soft-capping.
        window: sliding window.
        value_gain: factor on every K and V value (tiny or huge magnitudes).
        contiguous_pages: V pages and group scales token-major (contiguous) instead of the
            cache's layouts (:func:`kvquant.kernels.page_storage`,
            :func:`kvquant.kernels.group_scale_storage`).
        k_transform: None, "biased", "offset", "rotation" or "both" (biased K channels,
            static scales; the same seed gives the same K, V and query for each); with
            "fp32-group" only "biased" or "rotation" (Hadamard-rotated K, group scales).
        first_lens: first tokens per sequence taken from the side buffer, or None.
        n_first: ``NF``, the side buffer's tokens per row (>= every ``first_lens``).
        first_dtype: dtype of ``first_k`` / ``first_v``.
        device: where the tensors live.
        seed: RNG seed.

    Returns:
        A :class:`PagedCase`.
    """
    gen = torch.Generator().manual_seed(seed)
    bsz = len(lens)
    lmax = max(max(lens), 1)
    block_tables, slots, num_pages = shuffled_pages(lens, page, gen)

    head_gain = torch.linspace(0.5, 3.0, hkv).view(1, 1, hkv, 1)
    key = torch.randn(bsz, lmax, hkv, d, generator=gen) * head_gain * value_gain
    value = torch.randn(bsz, lmax, hkv, d, generator=gen) * head_gain.flip(2) * value_gain
    rotation = offset = None
    if k_transform is not None:
        # a few near-constant channels of large magnitude (the RoPE bias), per KV head
        bias = torch.zeros(hkv, d)
        chans = torch.randperm(d, generator=gen)[:3]
        bias[:, chans] = (torch.rand(hkv, 3, generator=gen) * 10 + 10) * value_gain
        key = key * 0.5 + bias
        if k_transform in ("rotation", "both"):
            rotation = hadamard(d)
        rotated = key if rotation is None else key @ rotation
        if k_transform in ("offset", "both"):
            offset = rotated[:, 1:].mean(dim=(0, 1))  # [Hkv, D], rotated frame
        elif k_transform not in ("rotation", "biased"):
            raise ValueError(f"unknown k_transform {k_transform!r}")
    nan_code = torch.full((num_pages, page, hkv, d), float("nan")).to(fp8)
    if contiguous_pages:
        k_pages, v_pages = nan_code.clone(), nan_code.clone()
    else:  # the cache's layout
        k_pages, v_pages = page_storage(num_pages, page, hkv, d, dtype=fp8)
        k_pages.copy_(nan_code)
        v_pages.copy_(nan_code)
    group_scales: tuple[torch.Tensor, torch.Tensor] | tuple[None, None] = (None, None)
    scheme: Scheme
    limit = fp8_max(fp8)
    if granularity == "fp32-group":
        if k_transform not in (None, "biased", "rotation"):
            raise ValueError("fp32-group scales take a K rotation, not an offset")
        if contiguous_pages:
            k_gs, v_gs = (torch.empty(num_pages, page, hkv, d // group_size) for _ in "kv")
        else:  # the cache's (head-major) layout
            k_gs, v_gs = (group_scale_storage(num_pages, page, hkv, d // group_size) for _ in "kv")
        group_scales = (k_gs.fill_(float("nan")), v_gs.fill_(float("nan")))
        scheme = GroupScales(head_dim=d, group_size=group_size, k_rotation=rotation)
    elif k_transform not in (None, "biased"):  # static scales of the stored (transformed) K
        stored = key if rotation is None else key @ rotation
        stored = stored if offset is None else stored - offset
        k_amax = stored.abs().amax(dim=(0, 1, 3))
        v_amax = value.abs().amax(dim=(0, 1, 3))
        if granularity == "per-tensor":
            k_amax, v_amax = k_amax.amax().reshape(()), v_amax.amax().reshape(())
        scheme = KTransformScales(k_amax / limit, v_amax / limit, offset, rotation, n_first)
    elif granularity == "per-head":
        scheme = PerHeadScales(
            key.abs().amax(dim=(0, 1, 3)) / limit, value.abs().amax(dim=(0, 1, 3)) / limit
        )
    elif granularity == "per-tensor":
        scheme = PerTensorScales(
            (key.abs().amax() / limit).reshape(()), (value.abs().amax() / limit).reshape(())
        )
    else:
        raise ValueError(f"unknown granularity {granularity!r}")
    write_kv_reference(key, value, Pages(k_pages, v_pages, *group_scales), slots, scheme)
    first = None
    if first_lens is not None:
        starts = kv_start if kv_start is not None else [0] * bsz
        first_k = torch.full((bsz, n_first, hkv, d), float("nan"))
        first_v = torch.full((bsz, n_first, hkv, d), float("nan"))
        rotated = key if rotation is None else key @ rotation
        for b, (s0, nf) in enumerate(zip(starts, first_lens, strict=True)):
            first_k[b, :nf] = rotated[b, s0 : s0 + nf]
            first_v[b, :nf] = value[b, s0 : s0 + nf]
        first = FirstTokens(
            first_k.to(device=device, dtype=first_dtype),
            first_v.to(device=device, dtype=first_dtype),
            torch.tensor(first_lens, dtype=torch.int32, device=device),
        )
        # the first tokens' slots were written, but the attention must never read them
        for b, (s0, nf) in enumerate(zip(starts, first_lens, strict=True)):
            for pos in range(s0, s0 + nf):
                slot = int(slots[b, pos])
                k_pages[slot // page, slot % page] = nan_code[0, 0]
                v_pages[slot // page, slot % page] = nan_code[0, 0]

    if hf_layout:
        query = torch.randn(bsz, hq, lq, d, generator=gen).to(qdtype).transpose(1, 2)
    else:
        query = torch.randn(bsz, lq, hq, d, generator=gen).to(qdtype)

    def index(values: list[int] | None) -> torch.Tensor | None:
        return None if values is None else torch.tensor(values, dtype=torch.int32, device=device)

    mask = Mask(causal, window, softcap, kv_start=index(kv_start), q_lens=index(q_lens))
    return PagedCase(
        query=query.to(device),
        pages=Pages(*(x.to(device) for x in (k_pages, v_pages, *group_scales) if x is not None)),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        scheme=scheme.to(device),
        sm_scale=d**-0.5,
        mask=mask,
        first=first,
        key=key.to(device),
        value=value.to(device),
    )

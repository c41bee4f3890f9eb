"""Learned attention sinks (gpt-oss): the reference against dense math, the Triton kernel against it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from numerics import assert_close_rel

from kvquant.errors import KernelInputError
from kvquant.kernels import (
    group_scale_storage,
    hadamard,
    page_storage,
    paged_attention,
    write_kv,
)
from kvquant.kernels.attention.launch import paged_attention_triton
from kvquant.schemes import GroupScales, Mask, Pages, PerTensorScales, Scheme

HKV, HQ, D, PS, PAGES, T = 2, 4, 16, 4, 8, 13
BT = torch.tensor([[3, 0, 5, 1]], dtype=torch.int32)  # shuffled pages, partial last page
LENS = torch.tensor([T], dtype=torch.int32)


def _cache(groups: bool, device: str = "cpu", rotate: bool = False) -> tuple[Pages, Scheme]:
    """K/V of ``T`` random tokens written into shuffled pages; the pages and their scheme
    (``rotate``: group scales of Hadamard-rotated keys)."""
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, T, HKV, D, generator=gen).to(device) for _ in range(2))
    kp, vp = page_storage(PAGES, PS, HKV, D, device=device)
    pos = torch.arange(T)
    slots = (BT[0].long()[pos // PS] * PS + pos % PS)[None].to(device)
    scheme: Scheme
    if groups:
        kg, vg = (group_scale_storage(PAGES, PS, HKV, 2, device=device) for _ in "kv")
        rotation = hadamard(D, device=device) if rotate else None
        scheme = GroupScales(head_dim=D, group_size=D // 2, k_rotation=rotation)
        pages = Pages(kp, vp, kg, vg)
    else:
        s = torch.tensor(0.02, device=device)
        pages, scheme = Pages(kp, vp), PerTensorScales(s, s)
    write_kv(k, v, pages, slots, scheme, backend="torch" if device == "cpu" else "auto")
    return pages, scheme


def _dense(
    q: torch.Tensor, pages: Pages, scheme: Scheme, sinks: torch.Tensor, start: int
) -> torch.Tensor:
    """Softmax over [scores, sink] with the sink's column dropped, on the dequantized K/V."""
    from kvquant.kernels.fp8 import dequantize_pages

    ids = BT[0].long()
    view = scheme.kernel_view()
    kv = []
    for codes, static, groups in (
        (pages.k, view.k_scale, pages.k_scales),
        (pages.v, view.v_scale, pages.v_scales),
    ):
        full = dequantize_pages(codes[ids], static, None if groups is None else groups[ids])
        kv.append(full.reshape(-1, HKV, D)[:T].repeat_interleave(HQ // HKV, dim=1))
    lq = q.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q[0].float(), kv[0]) * 0.25
    pos = torch.arange(T - lq, T)[:, None]
    cols = torch.arange(T)[None]
    scores = scores.masked_fill(~((cols >= start) & (cols <= pos)), float("-inf"))
    logits = torch.cat([scores, sinks[:, None, None].expand(-1, lq, 1)], dim=-1)
    return torch.einsum("hqk,khd->qhd", logits.softmax(-1)[..., :-1], kv[1])[None]


@pytest.mark.parametrize("groups", [False, True])
@pytest.mark.parametrize("q_len", [1, 5])
def test_reference_sinks_equal_dense_softmax_with_a_sink_column(q_len: int, groups: bool) -> None:
    pages, scheme = _cache(groups)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, q_len, HQ, D, generator=gen)
    sinks = torch.randn(HQ, generator=gen) * 2
    start = torch.tensor([2], dtype=torch.int32)
    got = paged_attention(q, pages, BT, LENS, scheme, sm_scale=0.25,
                          mask=Mask(kv_start=start, sinks=sinks), backend="torch")  # fmt: skip
    torch.testing.assert_close(got, _dense(q, pages, scheme, sinks, 2), rtol=1e-5, atol=1e-6)
    without = paged_attention(q, pages, BT, LENS, scheme, sm_scale=0.25,
                              mask=Mask(kv_start=start), backend="torch")  # fmt: skip
    assert (got - without).abs().max() > 1e-2  # the sinks take weight away from the keys


@pytest.mark.parametrize(
    ("q_len", "groups", "opts", "rotate"),
    [
        (1, False, {"num_splits": 1}, False),
        (1, False, {"num_splits": 3}, False),  # the split reduction adds the sink once
        (1, True, {"num_splits": 2, "config": {"FOLD": True}}, False),
        (1, True, {"num_splits": 1, "config": {"FOLD": False}}, False),
        (5, False, {}, False),
        (5, True, {}, False),
        # group scales of Hadamard-rotated keys (the query is rotated alike)
        (1, True, {"num_splits": 2, "config": {"FOLD": True}}, True),
        (1, True, {"num_splits": 1, "config": {"FOLD": False}}, True),
        (5, True, {}, True),
    ],
)
def test_triton_sinks_match_the_reference(
    q_len: int, groups: bool, opts: dict[str, Any], rotate: bool
) -> None:
    pages, scheme = _cache(groups, rotate=rotate)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, q_len, HQ, D, generator=gen)
    sinks = torch.randn(HQ, generator=gen) * 2
    mask = Mask(kv_start=torch.tensor([2], dtype=torch.int32), sinks=sinks)
    ref = paged_attention(q, pages, BT, LENS, scheme, sm_scale=0.25, mask=mask, backend="torch")
    got = paged_attention_triton(q, pages, BT, LENS, scheme, sm_scale=0.25, mask=mask, **opts)
    name = f"sinks q_len={q_len} groups={groups} rotate={rotate} {opts}"
    assert_close_rel(got, ref, rel_tol=5e-3, name=name)


@pytest.mark.parametrize(
    "sinks",
    [
        torch.zeros(HQ, dtype=torch.float64),
        torch.zeros(HQ + 1),
        torch.zeros(2 * HQ)[::2],
        torch.tensor([0.0, float("nan"), 0.0, 0.0]),
        torch.tensor([0.0, 0.0, float("inf"), 0.0]),
    ],
)
def test_bad_sinks_are_refused(sinks: torch.Tensor) -> None:
    pages, scheme = _cache(False)
    q = torch.randn(1, 1, HQ, D)
    with pytest.raises(KernelInputError, match="sinks"):
        paged_attention(q, pages, BT, LENS, scheme, sm_scale=0.25, mask=Mask(sinks=sinks))


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 5])
def test_triton_sinks_on_cuda(q_len: int) -> None:
    pages, scheme = _cache(True, "cuda")
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, q_len, HQ, D, generator=gen).cuda()
    sinks = (torch.randn(HQ, generator=gen) * 2).cuda()
    args = (q, pages, BT.cuda(), LENS.cuda(), scheme)
    got = paged_attention(*args, sm_scale=0.25, mask=Mask(sinks=sinks), backend="triton")
    ref = paged_attention(*args, sm_scale=0.25, mask=Mask(sinks=sinks), backend="torch")
    assert_close_rel(got, ref, rel_tol=5e-3, name=f"cuda sinks q_len={q_len}")

"""kvquant.calibrate.statistics: bounded K/V statistics, attention weights, near-constant K energy."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvquant.calibrate import (
    BINS_PER_OCTAVE,
    LOG2_MIN,
    ChannelStatistics,
    KVStatistics,
    attention_weights,
    collect_statistics,
)
from kvquant.calibrate.statistics import near_constant_share
from kvquant.errors import CalibrationError

pytest.importorskip("transformers")


def test_statistics_counts_amax_and_bins() -> None:
    torch.manual_seed(1)
    stats = KVStatistics(2, 3)
    k = torch.randn(2, 3, 50, 8) * torch.tensor([1.0, 10.0, 100.0]).view(1, 3, 1, 1)
    v = torch.randn(2, 3, 50, 8)
    k[0, 1, 0, 0] = 0.0  # zeros go to bin 0
    stats.update(1, k, v)
    assert torch.equal(stats.k_amax[1], k.abs().amax(dim=(0, 2, 3)))
    assert torch.equal(stats.v_amax[1], v.abs().amax(dim=(0, 2, 3)))
    assert torch.all(stats.k_hist[1].sum(dim=1) == 2 * 50 * 8)
    assert stats.k_hist[0].sum() == 0 and int(stats.updates[0]) == 0
    assert stats.k_hist[1, 1, 0] >= 1
    one = KVStatistics(1, 1)
    t = torch.full((1, 1, 1, 1), 1.0)
    one.update(0, t, t)
    assert int(one.k_hist[0, 0].argmax()) == -LOG2_MIN * BINS_PER_OCTAVE


def test_statistics_memory_does_not_grow_with_text_length(tiny: Any) -> None:
    model, _ = tiny
    short = collect_statistics(model, torch.randint(0, 128, (64,)), progress=False)
    long = collect_statistics(model, torch.randint(0, 128, (1024,)), window=128, progress=False)
    assert short.nbytes == long.nbytes
    assert (short.num_tokens, long.num_tokens) == (64, 1024)
    # every K element of every token was counted: tokens * head_dim per (layer, head)
    assert torch.all(long.k_hist.sum(dim=2) == 1024 * 16)
    assert torch.all(long.updates == 8)


def test_statistics_reject_bad_shapes_and_nonfinite(tiny: Any) -> None:
    stats = KVStatistics(1, 2)
    with pytest.raises(CalibrationError, match="expected \\[B, 2, T, D\\]"):
        stats.update(0, torch.zeros(1, 3, 4, 8), torch.zeros(1, 2, 4, 8))
    with pytest.raises(CalibrationError, match="layer 5"):
        stats.update(5, torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))
    x = torch.ones(1, 2, 4, 8)
    x[0, 0, 0, 0] = float("nan")
    stats.update(0, x, torch.ones(1, 2, 4, 8))
    assert stats.nonfinite == 1
    assert float(stats.k_hist[0].sum()) == 2 * 4 * 8 - 1
    assert float(stats.k_amax[0, 0]) == 1.0


def test_attention_weights_match_brute_force() -> None:
    torch.manual_seed(6)
    b, hq, hkv, t, d, scaling = 2, 4, 2, 7, 3, 0.7
    q = torch.randn(b, hq, t, d)
    k = torch.randn(b, hkv, t, d)
    wk, wv = attention_weights(q, k, scaling, block=3)
    kk = k.repeat_interleave(hq // hkv, dim=1)
    scores = (q @ kk.transpose(-1, -2)) * scaling
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    ref_wv = torch.zeros(b, hkv, t)
    ref_wk = torch.zeros(b, hkv, t, d)
    for h in range(hq):
        g = h // (hq // hkv)
        for i in range(t):
            for j in range(i + 1):
                ref_wv[:, g, j] += p[:, h, i, j] ** 2
                ref_wk[:, g, j] += scaling**2 * p[:, h, i, j, None] ** 2 * q[:, h, i] ** 2
    torch.testing.assert_close(wv, ref_wv[..., None].expand(b, hkv, t, d))
    torch.testing.assert_close(wk, ref_wk)


def test_near_constant_share_follows_its_definition() -> None:
    g = torch.Generator().manual_seed(0)
    n = 1000
    k = torch.randn(1, 1, n, 4, generator=g)
    k[..., 0] += 10.0  # sd 1 < 10 / 4: near-constant
    k[..., 1] += 2.0  # sd 1 > 2 / 4: not
    ch = ChannelStatistics(1, 1, 4, first_tokens=0)
    ch.update(0, k)
    share = ch.near_constant_share()
    energy = k.double().square().sum(dim=2)[0, 0]
    assert float(share[0, 0]) == pytest.approx(float(energy[0] / energy.sum()), rel=1e-9)
    zero = near_constant_share(torch.zeros(1), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    assert float(zero[0, 0]) == 0.0

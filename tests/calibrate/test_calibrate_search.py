"""kvquant.calibrate.search: the expected-MSE model and the clipping search."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from kvquant.calibrate import (
    KVStatistics,
    calibrate,
    choose_scales,
    collect_statistics,
    expected_mse,
    search_ratios,
)
from kvquant.errors import CalibrationError

pytest.importorskip("transformers")

E4M3_MAX = 448.0


def _stats_of(x: torch.Tensor) -> KVStatistics:
    """One layer, one head, K = V = x."""
    stats = KVStatistics(1, 1)
    t = x.reshape(1, 1, -1, 1)
    stats.update(0, t, t)
    return stats


def _exact_mse(x: torch.Tensor, ratio: float) -> float:
    s = x.abs().max() * ratio / E4M3_MAX
    q = (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s
    return float(((x - q).double() ** 2).mean())


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(100_000),
        lambda: torch.rand(100_000) * 7.0,
        lambda: torch.distributions.StudentT(2.0).sample((100_000,)),
    ],
)
def test_histogram_mse_matches_direct_quantization(make: Any) -> None:
    torch.manual_seed(2)
    x = make()
    stats = _stats_of(x)
    ratios = (0.6, 0.8, 0.9, 1.0)
    mse = expected_mse(stats.k_hist[0], stats.k_amax[0], ratios)[0]
    for j, r in enumerate(ratios):
        exact = _exact_mse(x, r)
        assert abs(float(mse[j]) / exact - 1.0) < 0.05, (r, float(mse[j]), exact)


def test_search_keeps_amax_when_clipping_cannot_help() -> None:
    # every value is an e4m3 code at scale amax/448: r = 1 quantizes exactly
    torch.manual_seed(3)
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes) & (codes > 0)]
    x = codes[torch.randint(0, codes.numel(), (50_000,))] * (3.0 / E4M3_MAX)
    x[0] = 3.0
    stats = _stats_of(x)
    ratio, mse = search_ratios(stats.k_hist[0], stats.k_amax[0])
    assert float(ratio[0]) == 1.0
    assert float(mse[0, -1]) < float(mse[0, :-1].min())
    res = choose_scales(stats)
    assert res.layers[0].k_ratio == (1.0,) and res.layers[0].k_saturation == 0.0
    assert float(res.k_scales[0]) == pytest.approx(3.0 / E4M3_MAX, rel=1e-7)


def test_search_uniform_data_is_nearly_indifferent() -> None:
    torch.manual_seed(4)
    x = torch.rand(200_000) * 5.0
    stats = _stats_of(x)
    ratio0, mse = search_ratios(stats.k_hist[0], stats.k_amax[0])
    # clipping the top ~2 % buys a few percent of MSE on uniform data ...
    assert 0.95 <= float(ratio0[0]) < 1.0
    assert float(mse[0].min()) > 0.9 * float(mse[0, -1])
    # ... and a 5 % tolerance keeps amax / 448
    ratio5, _ = search_ratios(stats.k_hist[0], stats.k_amax[0], tolerance=0.05)
    assert float(ratio5[0]) == 1.0


def test_search_clips_heavy_tails() -> None:
    torch.manual_seed(5)
    bulk = torch.randn(200_000) * 1e-3
    tail = torch.distributions.StudentT(1.0).sample((200_000,)).abs() * 1e-3
    x = torch.cat([bulk, tail.clamp(max=20.0)])
    stats = _stats_of(x)
    res = choose_scales(stats)
    layer = res.layers[0]
    assert layer.k_ratio[0] < 1.0
    assert layer.k_saturation > 0.0
    assert layer.k_mse_vs_amax < 0.99
    assert _exact_mse(x, layer.k_ratio[0]) < _exact_mse(x, 1.0)


def test_search_validates_its_options() -> None:
    stats = _stats_of(torch.randn(100))
    with pytest.raises(CalibrationError, match="include"):
        search_ratios(stats.k_hist[0], stats.k_amax[0], (0.5, 0.9))
    with pytest.raises(CalibrationError, match="tolerance"):
        search_ratios(stats.k_hist[0], stats.k_amax[0], tolerance=-1.0)
    with pytest.raises(CalibrationError, match="granularity"):
        choose_scales(stats, "fp32-group")
    with pytest.raises(CalibrationError, match="never saw"):
        choose_scales(KVStatistics(2, 1))


def test_attention_objective_needs_weighted_statistics(tiny: Any) -> None:
    model, _ = tiny
    ids = torch.randint(0, 128, (1, 96))
    plain = collect_statistics(model, ids, progress=False)
    with pytest.raises(CalibrationError, match="weighted"):
        choose_scales(plain, objective="attention")
    with pytest.raises(CalibrationError, match="objective"):
        choose_scales(plain, objective="logits")
    weighted = collect_statistics(model, ids, progress=False, objective="attention")
    assert weighted.nbytes > plain.nbytes
    torch.testing.assert_close(weighted.k_hist, plain.k_hist, rtol=0, atol=0)
    assert weighted.k_whist is not None and float(weighted.k_whist.sum()) > 0
    res = calibrate(model, ids, granularity="per-head", objective="attention", progress=False)
    assert res.objective == "attention" and tuple(res.v_scales.shape) == (2, 2)
    assert json.loads(res.to_json())["objective"] == "attention"

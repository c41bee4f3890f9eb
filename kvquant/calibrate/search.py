"""The clipping search: expected FP8 e4m3 error of every clipping ratio, from the histograms.

For a ratio ``r`` the scale is ``s = r * amax / 448``; :func:`expected_mse`
quantizes every histogram bin's centre with torch's own cast and weighs the
squared error by the bin's count (or attention weight). :func:`choose_scales`
keeps, per layer (and KV head), the largest ratio within ``tolerance`` of the
grid's minimum. The derivation: docs/dev/calibration.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvquant.calibrate.fp8 import FP8_E4M3_MAX
from kvquant.calibrate.options import (
    OBJECTIVES,
    STATIC_GRANULARITIES,
    Granularity,
    Objective,
    parse_choice,
)
from kvquant.calibrate.result import CalibrationResult, LayerCalibration
from kvquant.calibrate.statistics import (
    BINS_PER_OCTAVE,
    LOG2_MIN,
    KVStatistics,
    bin_centres,
    num_bins,
)
from kvquant.errors import CalibrationError

__all__ = [
    "DEFAULT_RATIOS",
    "check_grid",
    "choose_scales",
    "expected_mse",
    "search_ratios",
]

DEFAULT_RATIOS: tuple[float, ...] = tuple(round(0.5 + 0.01 * i, 2) for i in range(51))
"""The clipping ratios searched by default: 0.50, 0.51, ..., 1.00."""


def expected_mse(
    hist: torch.Tensor,
    amax: torch.Tensor,
    ratios: Sequence[float] | torch.Tensor,
) -> torch.Tensor:
    """Expected FP8 e4m3 squared error per value for each clipping ratio, from histograms.

    For ratio ``r`` the scale is ``s = r * amax / 448``; each bin centre ``c`` is
    quantized as the cache does (``fp8_e4m3fn(clamp(c / s, -448, 448)) * s``, the
    division in fp32) and ``(c - q)**2`` is averaged with the bin counts as weights.

    Args:
        hist: fp64 [N, num_bins] counts (N independent distributions).
        amax: [N] max |x| of each distribution.
        ratios: [R] clipping ratios in (0, 1].

    Returns:
        fp64 [N, R] mean squared error per value (0 for empty or all-zero rows).
    """
    r = torch.as_tensor(ratios, dtype=torch.float32)
    centres = bin_centres()
    c32 = centres.float()
    amax32 = amax.float()
    total = hist.sum(dim=1)
    out = torch.zeros((hist.shape[0], r.shape[0]), dtype=torch.float64)
    for j in range(r.shape[0]):
        s = amax32 * r[j] / FP8_E4M3_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = (c32[None, :] / s[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        q = q.to(torch.float8_e4m3fn).float() * s[:, None]
        err = (centres[None, :] - q.double()) ** 2
        out[:, j] = (hist * err).sum(dim=1) / total.clamp_min(1.0)
    return out


def _saturation(hist: torch.Tensor, amax: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """Estimated fraction of values above ``ratio * amax`` (saturated): fp64 [N].

    Whole bins above the threshold count fully; the bin holding the threshold
    counts by the share of its (logarithmic) width above it; nothing saturates
    at ``ratio == 1``.
    """
    n = num_bins()
    threshold = (amax.double() * ratio.double()).clamp_min(2.0**LOG2_MIN)
    lower = LOG2_MIN + torch.arange(n, dtype=torch.float64) / BINS_PER_OCTAVE
    # share of each bin [lower, lower + 1/bpo) lying above log2(threshold)
    above = (
        (lower[None, :] + 1.0 / BINS_PER_OCTAVE - torch.log2(threshold)[:, None]) * BINS_PER_OCTAVE
    ).clamp(0.0, 1.0)
    above[:, 0] = 0.0  # bin 0 holds zeros
    sat = (hist * above).sum(dim=1) / hist.sum(dim=1).clamp_min(1.0)
    return torch.where(ratio >= 1.0, torch.zeros_like(sat), sat)


def search_ratios(
    hist: torch.Tensor,
    amax: torch.Tensor,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    *,
    tolerance: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick a clipping ratio per distribution by expected FP8 MSE.

    Args:
        hist: fp64 [N, num_bins] histogram counts.
        amax: [N] max |x|.
        ratios: candidate ratios (searched in ascending order); must contain 1.0.
        tolerance: keep the largest ratio whose MSE is at most ``(1 + tolerance)``
            times the minimum over the grid (0: the exact argmin, largest on ties).

    Returns:
        ``(chosen_ratio fp32 [N], mse fp64 [N, R])`` with ``mse`` in ascending-ratio order.

    Raises:
        CalibrationError: ratios outside (0, 1], without 1.0, or a negative tolerance.
    """
    grid = check_grid(ratios, tolerance)
    idx, mse = _search(hist, amax, grid, tolerance)
    return torch.tensor(grid, dtype=torch.float32)[idx], mse


def check_grid(ratios: Sequence[float], tolerance: float) -> tuple[float, ...]:
    """The sorted ratio grid.

    Raises:
        CalibrationError: ratios outside (0, 1], without 1.0, or a negative tolerance.
    """
    grid = tuple(sorted({float(r) for r in ratios}))
    if not grid or grid[0] <= 0.0 or grid[-1] != 1.0:
        raise CalibrationError(
            f"search_ratios: ratios {list(grid[:3])}...{list(grid[-3:])} must lie in (0, 1] and "
            "include 1.0 (the amax / 448 scale). Fix: pass e.g. kvquant.calibrate.DEFAULT_RATIOS."
        )
    if not tolerance >= 0.0:
        raise CalibrationError(
            f"search_ratios: tolerance {tolerance}; expected >= 0. Fix: pass 0.0 or a small "
            "relative margin such as 0.01."
        )
    return grid


def _search(
    hist: torch.Tensor, amax: torch.Tensor, grid: Sequence[float], tolerance: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index into ``grid`` (ascending) of the chosen ratio per row: int64 [N], and the MSE table."""
    mse = expected_mse(hist, amax, grid)
    best = mse.min(dim=1, keepdim=True).values
    ok = mse <= best * (1.0 + tolerance)
    idx = torch.arange(len(grid)).expand_as(ok)
    return torch.where(ok, idx, torch.full_like(idx, -1)).amax(dim=1), mse


def choose_scales(
    stats: KVStatistics,
    granularity: Granularity | str = "per-tensor",
    *,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    tolerance: float = 0.0,
    objective: Objective | str = "mse",
    texts: Sequence[str] = (),
) -> CalibrationResult:
    """Choose scales from collected statistics (no model needed).

    Args:
        stats: statistics from :func:`collect_statistics`.
        granularity: ``"per-tensor"`` (one ratio per layer and kind, heads pooled)
            or ``"per-head"`` (one per layer, KV head and kind).
        ratios: ratio grid (must contain 1.0); ``(1.0,)`` gives plain ``amax / 448``.
        tolerance: relative MSE margin, see :func:`search_ratios`.
        objective: ``"mse"`` (every value counts once) or ``"attention"`` (values
            weighted by :func:`attention_weights`; needs ``stats.weighted``).
        texts: names of the calibration texts, for the report.

    Returns:
        A :class:`CalibrationResult`.

    Raises:
        CalibrationError: unknown granularity or objective, or a layer never saw any K/V.
    """
    goal = parse_choice(Objective, objective)
    if goal is None:
        raise CalibrationError(
            f"choose_scales: objective {objective!r}; expected one of {OBJECTIVES}. "
            "Fix: pass 'mse' or 'attention'."
        )
    if goal is Objective.ATTENTION and not stats.weighted:
        raise CalibrationError(
            "choose_scales: objective 'attention' needs attention-weighted statistics but "
            "these were collected unweighted. Fix: collect_statistics(..., objective='attention')."
        )
    chosen = parse_choice(Granularity, granularity)
    if chosen is None or chosen not in STATIC_GRANULARITIES:
        raise CalibrationError(
            f"choose_scales: granularity {granularity!r}; expected one of "
            f"{STATIC_GRANULARITIES}. Fix: fp32-group scales are dynamic and need no calibration."
        )
    missing = [i for i in range(stats.num_layers) if int(stats.updates[i]) == 0]
    if missing:
        raise CalibrationError(
            f"choose_scales: layers {missing[:8]} never saw K/V; expected every layer to run. "
            "Fix: collect statistics over at least one forward of the whole model."
        )
    grid = check_grid(ratios, tolerance)
    per_head = chosen is Granularity.PER_HEAD
    k = _pick(stats.k_hist, stats.k_whist, stats.k_amax, grid, tolerance, goal, per_head)
    v = _pick(stats.v_hist, stats.v_whist, stats.v_amax, grid, tolerance, goal, per_head)
    return CalibrationResult(
        granularity=chosen,
        k_scales=k.scale.contiguous(),
        v_scales=v.scale.contiguous(),
        layers=tuple(_layer(i, k, v) for i in range(stats.num_layers)),
        num_tokens=stats.num_tokens,
        num_kv_heads=stats.num_kv_heads,
        ratios=grid,
        tolerance=tolerance,
        objective=goal,
        texts=tuple(texts),
        statistics=stats,
        num_samples=stats.num_samples,
    )


class _Picked(NamedTuple):
    """The search's choice for one kind (K or V), per layer."""

    scale: torch.Tensor  # fp32 [L] or [L, H]
    ratio: torch.Tensor  # [L, 1] or [L, H]
    amax: torch.Tensor  # [L, 1] or [L, H]
    saturation: torch.Tensor  # [L]
    mse_vs_amax: torch.Tensor  # [L]


def _pick(
    hist: torch.Tensor,
    whist: torch.Tensor | None,
    amax: torch.Tensor,
    grid: tuple[float, ...],
    tolerance: float,
    objective: Objective,
    per_head: bool,
) -> _Picked:
    """Search one kind's histograms ([L, H, NB]) per layer, or per layer and head."""
    L, H = amax.shape
    weights = whist if objective is Objective.ATTENTION and whist is not None else hist
    if per_head:
        h = hist.reshape(L * H, -1)
        hw = weights.reshape(L * H, -1)
        a = amax.reshape(L * H)
    else:
        h = hist.sum(dim=1)  # [L, NB]
        hw = weights.sum(dim=1)
        a = amax.amax(dim=1)  # [L]
    chosen_idx, mse = _search(hw, a, grid, tolerance)
    ratio = torch.tensor(grid, dtype=torch.float32)[chosen_idx]
    scale = a * ratio / FP8_E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).float()
    counts = h.sum(dim=1)
    mass = hw.sum(dim=1)
    mse_chosen = mse.gather(1, chosen_idx[:, None])[:, 0] * mass
    mse_amax = mse[:, -1] * mass
    sat = _saturation(h, a, ratio) * counts
    shape: tuple[int, ...] = (L,)
    if per_head:
        shape = (L, H)
        mse_chosen, mse_amax, sat, counts = (
            t.view(L, H).sum(dim=1) for t in (mse_chosen, mse_amax, sat, counts)
        )
    return _Picked(
        scale.view(shape),
        ratio.view(L, -1),
        a.view(L, -1),
        sat / counts.clamp_min(1.0),
        torch.where(mse_amax > 0, mse_chosen / mse_amax, torch.ones_like(mse_amax)),
    )


def _layer(i: int, k: _Picked, v: _Picked) -> LayerCalibration:
    return LayerCalibration(
        layer=i,
        k_ratio=tuple(float(x) for x in k.ratio[i]),
        v_ratio=tuple(float(x) for x in v.ratio[i]),
        k_saturation=float(k.saturation[i]),
        v_saturation=float(v.saturation[i]),
        k_mse_vs_amax=float(k.mse_vs_amax[i]),
        v_mse_vs_amax=float(v.mse_vs_amax[i]),
        k_amax=tuple(float(x) for x in k.amax[i]),
        v_amax=tuple(float(x) for x in v.amax[i]),
    )

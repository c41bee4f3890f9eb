"""The k-transform from collected statistics: rotate K, subtract a per-channel offset, scale per head.

Per layer and KV head, K is rotated (Hadamard, or not), offset by the
per-channel centre of the calibration tokens (the first tokens of every window
left out: attention reads them exactly) and scaled by the amax of the result;
V gets the per-head clipping search. Why: docs/dev/calibration.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvquant.calibrate.fp8 import FP8_E4M3_MAX
from kvquant.calibrate.options import Centre, Granularity, Objective, Rotation, is_rotation
from kvquant.calibrate.result import CalibrationResult, LayerCalibration
from kvquant.calibrate.search import DEFAULT_RATIOS, choose_scales
from kvquant.calibrate.statistics import KVStatistics
from kvquant.errors import CalibrationError

__all__ = ["choose_k_transform", "k_transform_name"]


def k_transform_name(rotation: str | None, first_tokens: int) -> str:
    """The report's name of a k-transform variant (``"k-transform (hadamard, first tokens)"``)."""
    rot = "hadamard" if rotation == Rotation.HADAMARD else "offset only"
    first = "first tokens" if first_tokens else "no first tokens"
    return f"k-transform ({rot}, {first})"


def choose_k_transform(
    stats: KVStatistics,
    *,
    rotation: Rotation | str | None = "hadamard",
    first_tokens: bool = True,
    centre: Centre | str = "mean",
    ratios: Sequence[float] = DEFAULT_RATIOS,
    tolerance: float = 0.0,
    objective: Objective | str = "mse",
    texts: Sequence[str] = (),
) -> CalibrationResult:
    """The static K transform from collected statistics (no model needed).

    Per layer and KV head: rotate K (``rotation="hadamard"``; None: identity),
    offset ``c`` = the per-channel ``centre`` of ``k R`` over the calibration
    tokens (the first ``stats.channels.first_tokens`` of each window left out
    when ``first_tokens``: the attention reads them exactly), K scale = amax of
    ``k R - c`` / 448 (:meth:`ChannelStatistics.k_transform`). V: per-head, by
    the same search as :func:`choose_scales`.

    Args:
        stats: statistics from :func:`collect_statistics` (with channel statistics).
        rotation: ``"hadamard"`` or None.
        first_tokens: keep the first tokens apart (``stats.channels.first_tokens``
            of them); False: none, every token counts.
        centre: ``"mean"`` or ``"midrange"``.
        ratios: ratio grid of the V search.
        tolerance: relative MSE margin of the V search.
        objective: objective of the V search.
        texts: names of the calibration texts, for the report.

    Returns:
        A :class:`CalibrationResult` with granularity ``"k-transform"``.

    Raises:
        CalibrationError: no channel statistics, an unknown rotation or centre,
            rotation with a head_dim that is not a power of two, or bad search options.
    """
    ch = stats.channels
    if ch is None:
        raise CalibrationError(
            "choose_k_transform: these statistics have no per-channel K statistics; expected "
            "them for the k-transform. Fix: collect with collect_statistics (it keeps them)."
        )
    if not is_rotation(rotation):
        raise CalibrationError(
            f"choose_k_transform: rotation {rotation!r}; expected 'hadamard' or None. "
            "Fix: pass one of those."
        )
    rotate = None if rotation is None else Rotation(rotation)
    apart = first_tokens and ch.first_tokens > 0
    offset, k_scale = ch.k_transform(rotate=rotate is not None, apart=apart, centre=centre)
    head = choose_scales(
        stats, "per-head", ratios=ratios, tolerance=tolerance, objective=objective, texts=texts
    )
    layers = tuple(
        LayerCalibration(
            layer=lay.layer,
            k_ratio=(1.0,) * stats.num_kv_heads,
            v_ratio=lay.v_ratio,
            k_saturation=0.0,
            v_saturation=lay.v_saturation,
            k_mse_vs_amax=1.0,
            v_mse_vs_amax=lay.v_mse_vs_amax,
            k_amax=tuple(float(x) * FP8_E4M3_MAX for x in k_scale[lay.layer]),
            v_amax=lay.v_amax,
        )
        for lay in head.layers
    )
    return replace(
        head,
        granularity=Granularity.K_TRANSFORM,
        k_scales=k_scale,
        layers=layers,
        k_offset=offset,
        rotation=rotate,
        first_tokens=ch.first_tokens if apart else 0,
        centre=Centre(centre),
    )

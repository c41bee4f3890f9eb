"""Model-level scale resolution: raw checkpoint scales in, canonical per-layer scales out.

Two entry points share one implementation: :func:`analyze_scales` records every
problem per layer and never raises for the scales' contents (the ``kvquant
doctor`` view); :func:`resolve_scales` runs the same analysis, logs lossy
conversions once, and raises one :class:`~kvquant.errors.ScaleFormatError`
listing all problems. Both raise at once for caller errors (an unknown option
value or format name, an impossible geometry).

Design: docs/dev/registry.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvquant.registry.formats import ScaleFormat
from kvquant.registry.options import ResolveOptions
from kvquant.registry.registry import (
    ScaleFormatRegistry,
)
from kvquant.registry.resolve_analysis import analyze_scales
from kvquant.registry.resolve_results import Action, LayerScales, ModelScales, ScaleRecord
from kvquant.types import (
    LayerGeometry,
    RawKTransform,
    RawScale,
)

__all__ = [
    "Action",
    "LayerScales",
    "ModelScales",
    "ScaleRecord",
    "analyze_scales",
    "resolve_scales",
]

logger = logging.getLogger("kvquant")


def resolve_scales(
    raw_scales: Sequence[RawScale],
    geometry: LayerGeometry,
    *,
    scale_format: str | ScaleFormat = "auto",
    missing_scales: str = "dynamic",
    group_size: int | None = None,
    missing_kv: str = "error",
    rope_policy: str = "widen",
    registry: ScaleFormatRegistry | None = None,
    options: ResolveOptions | None = None,
    k_transform: RawKTransform | None = None,
) -> ModelScales:
    """Turn a model's raw checkpoint scales into canonical per-layer scales, or raise.

    Args:
        raw_scales: every KV scale discovery found (any order; at most one
            ``k``, ``v`` and ``kv`` per layer).
        geometry: the model's attention geometry.
        scale_format: ``"auto"`` (per-head if any layer stores per-head scales,
            per-tensor if all are scalars, fp32-group if there are none);
            ``"per-tensor"`` (per-head and query-head vectors reduced with max:
            lossy, logged once with the cost); ``"per-head"`` (scalars
            broadcast: lossless); ``"fp32-group"`` (dynamic; checkpoint scales
            ignored, noted); the name of a registered user format, or a
            :class:`ScaleFormat` instance, which then reads every tensor.
        missing_scales: when no layer has a scale: ``"dynamic"`` (fp32-group,
            noted; default), ``"error"``, or ``"unit"`` (1.0 everywhere, warned).
        group_size: ``G`` for fp32-group; ``None``: 64 capped at ``head_dim``.
        missing_kv: a layer with only K or only V: ``"error"`` (default) or
            ``"reuse"`` (the one present serves both, noted).
        rope_policy: K calibrated before RoPE (Quark default): ``"widen"``
            (x sqrt(2), default) or ``"keep"``.
        registry: the registry to detect formats in (default: the process-wide one).
        options: all of the options above as one :class:`ResolveOptions` (what
            :func:`kvquant.patch`, ``KVQuantConfig`` and ``kvquant doctor``
            pass); then the individual options must be left at their defaults.
        k_transform: the checkpoint's K transform (per-layer ``k_offset``
            tensors and settings, :attr:`DiscoveredCheckpoint.k_transform
            <kvquant.checkpoint.discovery.DiscoveredCheckpoint.k_transform>`), or
            None. With ``"auto"`` it selects the ``k-transform`` target; a
            static ``per-tensor`` / ``per-head`` format with a K transform is a
            problem (the scales were calibrated for offset keys);
            ``"fp32-group"`` ignores it (noted).

    Returns:
        The canonical scales and the report (:meth:`ModelScales.to_dict`,
        :meth:`ModelScales.report`).

    Raises:
        ScaleFormatError: listing every problem found (first ten in full, then
            a count), or an invalid option / geometry.
        UnknownFormatError: ``scale_format`` names no registered format.
        OptionError: ``options`` and individual options were both given.

    Example:
        >>> import torch
        >>> from kvquant.registry import LayerGeometry, RawScale, resolve_scales
        >>> geometry = LayerGeometry(num_layers=1, num_heads=8, num_kv_heads=2, head_dim=64)
        >>> raws = [
        ...     RawScale(0, "k", "model.layers.0.self_attn.k_scale", "compressed-tensors",
        ...              torch.tensor([0.02], dtype=torch.bfloat16)),
        ...     RawScale(0, "v", "model.layers.0.self_attn.v_scale", "compressed-tensors",
        ...              torch.tensor([0.01], dtype=torch.bfloat16)),
        ... ]
        >>> scales = resolve_scales(raws, geometry)
        >>> scales.granularity, scales[0].k.dtype, tuple(scales[0].k.shape)
        ('per-tensor', torch.float32, ())
        >>> scales[0].k_record.action
        'convert'
    """
    scales = analyze_scales(
        raw_scales,
        geometry,
        scale_format=scale_format,
        missing_scales=missing_scales,
        group_size=group_size,
        missing_kv=missing_kv,
        rope_policy=rope_policy,
        registry=registry,
        options=options,
        k_transform=k_transform,
    )
    scales.raise_for_problems()
    _log_once(scales)
    return scales


def _log_once(scales: ModelScales) -> None:
    """One warning for lossy or risky choices (:attr:`Conversion.lossy`), one debug line for the rest."""
    lossy = [c.note for c in scales.conversions if c.lossy]
    other = [n for n in scales.notes if n not in lossy]
    if lossy:
        logger.warning("kvquant KV scales: %s", "; ".join(lossy))
    logger.debug(
        "kvquant KV scales: %s for %d layers%s",
        scales.granularity,
        len(scales.layers),
        ("; " + "; ".join(other)) if other else "",
    )

"""Resolution without static scales: the dynamic ``fp32-group`` format and the ``missing_scales``
policies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from kvquant.registry.conversions import AppliedConversion, Conversion
from kvquant.registry.formats import ScaleFormat
from kvquant.registry.policy import (
    model_group_size,
)
from kvquant.registry.resolve_reading import record_of
from kvquant.registry.resolve_results import LayerScales, ModelScales, ScaleRecord
from kvquant.schemes import GroupScales, PerTensorScales, Scheme
from kvquant.types import (
    LayerGeometry,
    RawScale,
)

__all__ = [
    "dynamic_layers",
    "no_scales",
]


def dynamic_layers(
    raw_scales: Sequence[RawScale],
    geometry: LayerGeometry,
    group_size: int | None,
    options: dict[str, Any],
    name: str,
    *,
    explicit: bool,
    reason: str | None,
    problems: Sequence[str] = (),
) -> ModelScales:
    size = model_group_size(group_size, geometry)
    by_layer: dict[tuple[int, str], RawScale] = {}
    for raw in raw_scales:
        for kind in ("k", "v") if raw.kind == "kv" else (raw.kind,):
            by_layer.setdefault((raw.layer, kind), raw)
    layers = []
    why = reason or f"{name}: scales computed per token and group of {size} when written"
    for layer in range(geometry.num_layers):
        recs = []
        for kind in ("k", "v"):
            kind_lit: Literal["k", "v"] = "k" if kind == "k" else "v"
            found = by_layer.get((layer, kind))
            if found is not None:
                recs.append(
                    record_of(
                        found,
                        layer,
                        kind_lit,
                        "ignore",
                        f'checkpoint scale ignored: scale_format="{name}" computes scales '
                        "while writing the cache",
                        fmt=name,
                        scheme=GroupScales,
                    )
                )
            else:
                recs.append(
                    record_of(None, layer, kind_lit, "default", why, fmt=name, scheme=GroupScales)
                )
        layers.append(
            LayerScales(
                layer=layer,
                scheme=GroupScales,
                k=None,
                v=None,
                group_size=size,
                source="dynamic",
                k_record=recs[0],
                v_record=recs[1],
            )
        )
    applied: list[AppliedConversion] = []
    every = tuple(range(geometry.num_layers))
    if explicit and raw_scales:
        applied.append(
            AppliedConversion(
                Conversion.CHECKPOINT_IGNORED,
                f'scale_format="{name}": {len(raw_scales)} checkpoint scale tensor(s) ignored; '
                f"scales are computed per token, KV head and group of {size} elements",
                every,
            )
        )
    elif not explicit:
        applied.append(
            AppliedConversion(
                Conversion.DYNAMIC_DEFAULT,
                f"no KV scales in the checkpoint: using {name} dynamic scales (G={size}, "
                'missing_scales="dynamic"); pass missing_scales="error" to refuse instead',
                every,
            )
        )
    notes = [a.note for a in applied]
    return ModelScales(
        geometry=geometry,
        scheme=GroupScales,
        group_size=size,
        layers=tuple(layers),
        notes=tuple(notes),
        problems=tuple(problems),
        options=options,
        conversions=tuple(applied),
    )


def no_scales(
    geometry: LayerGeometry,
    group_size: int | None,
    options: dict[str, Any],
    missing_scales: str,
    requested: ScaleFormat | None,
    target: type[Scheme] | None,
    problems: list[str],
) -> ModelScales:
    """Apply ``missing_scales`` when no layer has a checkpoint scale."""
    if missing_scales == "dynamic" and requested is None:
        return dynamic_layers(
            (),
            geometry,
            group_size,
            options,
            GroupScales.name,
            explicit=False,
            reason=None,
            problems=problems,
        )
    if missing_scales == "unit":
        return _unit_scales(geometry, options, target, problems)
    return _rejected_for_no_scales(geometry, options, missing_scales, requested, target, problems)


def _unit_scales(
    geometry: LayerGeometry,
    options: dict[str, Any],
    target: type[Scheme] | None,
    problems: list[str],
) -> ModelScales:
    """``missing_scales="unit"``: scale 1.0 for every layer (noted as lossy)."""
    scheme = target or PerTensorScales
    reason = 'no KV scale in the checkpoint; 1.0 used (missing_scales="unit")'
    layers = []
    for layer in range(geometry.num_layers):
        shape = scheme.scale_shape(geometry.kv_heads_of(layer)) or ()  # a static target
        k = torch.ones(shape, dtype=torch.float32)
        v = torch.ones(shape, dtype=torch.float32)
        layers.append(
            LayerScales(
                layer=layer,
                scheme=scheme,
                k=k,
                v=v,
                group_size=None,
                source="unit",
                k_record=ScaleRecord(
                    layer,
                    "k",
                    "default",
                    reason,
                    granularity=scheme.name,
                    scale=tuple(float(x) for x in k.reshape(-1)),
                ),
                v_record=ScaleRecord(
                    layer,
                    "v",
                    "default",
                    reason,
                    granularity=scheme.name,
                    scale=tuple(float(x) for x in v.reshape(-1)),
                ),
            )
        )
    note = (
        'no KV scales in the checkpoint: every scale set to 1.0 (missing_scales="unit"). '
        "Values above 448 saturate and small ones lose precision; this has cost accuracy "
        "in other engines. Calibrate, or use the default dynamic fp32-group scales"
    )
    return ModelScales(
        geometry=geometry,
        scheme=scheme,
        group_size=None,
        layers=tuple(layers),
        notes=(note,),
        problems=tuple(problems),
        options=options,
        conversions=(
            AppliedConversion(Conversion.UNIT_DEFAULT, note, tuple(range(geometry.num_layers))),
        ),
    )


def _rejected_for_no_scales(
    geometry: LayerGeometry,
    options: dict[str, Any],
    missing_scales: str,
    requested: ScaleFormat | None,
    target: type[Scheme] | None,
    problems: list[str],
) -> ModelScales:
    """No scales where they are needed: every layer rejected, with the fix."""
    last = geometry.num_layers - 1
    if missing_scales == "error":
        problem = (
            f"the checkpoint has no KV scales; expected K and V scales for layers 0-{last} "
            '(missing_scales="error"). Fix: calibrate and export KV scales (llm-compressor, '
            'ModelOpt, Quark), or patch(model, missing_scales="dynamic") to compute them '
            "while writing the cache."
        )
    else:
        name = requested.name if requested is not None else "auto"
        problem = (
            f'scale_format="{name}" needs checkpoint KV scales but the checkpoint has none; '
            f'expected K and V scales for layers 0-{last}. Fix: use scale_format="auto" or '
            '"fp32-group" to compute scales while writing the cache, or '
            'missing_scales="unit" to use 1.0 (lossy).'
        )
    scheme = target or GroupScales
    reason = "no KV scale in the checkpoint"
    layers = [
        LayerScales(
            layer=layer,
            scheme=scheme,
            k=None,
            v=None,
            group_size=None,
            source="none",
            k_record=record_of(None, layer, "k", "reject", reason, scheme=scheme),
            v_record=record_of(None, layer, "v", "reject", reason, scheme=scheme),
            problems=(problem,),  # every layer lacks its scales
        )
        for layer in range(geometry.num_layers)
    ]
    return ModelScales(
        geometry=geometry,
        scheme=scheme,
        group_size=None,
        layers=tuple(layers),
        notes=(),
        problems=(*problems, problem),
        options=options,
    )

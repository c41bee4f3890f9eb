"""Reading the raw scales of a model's layers: statistics, shape errors, and the per-layer reads
that resolution decides on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from kvquant.errors import ScaleFormatError
from kvquant.registry.conversions import Conversion
from kvquant.registry.formats import QueryHeadMaxFormat, ScaleFormat
from kvquant.registry.policy import (
    check_dtype,
    format_shape,
    format_shapes,
    pair_kv,
)
from kvquant.registry.registry import (
    ScaleFormatRegistry,
)
from kvquant.registry.resolve_results import BUILTIN_NAMES, Action, ScaleRecord, dtype_name
from kvquant.schemes import Scheme
from kvquant.types import (
    LayerGeometry,
    RawScale,
)

__all__ = [
    "LayerReads",
    "RawRead",
    "read_layers",
    "record_of",
]


@dataclass
class _Stats:
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    low: float | None = None
    high: float | None = None


def _raw_stats(raw: RawScale) -> _Stats:
    tensor = raw.tensor
    if not isinstance(tensor, torch.Tensor):
        return _Stats()
    stats = _Stats(shape=tuple(int(s) for s in tensor.shape), dtype=dtype_name(tensor.dtype))
    if (
        tensor.numel() == 0
        or tensor.device.type == "meta"
        or tensor.dtype.is_complex
        or tensor.layout != torch.strided
    ):
        return stats
    try:
        values = tensor.detach().to(device="cpu", dtype=torch.float64)
    except (RuntimeError, NotImplementedError, TypeError):
        return stats
    stats.low = float(values.min())
    stats.high = float(values.max())
    return stats


def record_of(
    raw: RawScale | None,
    layer: int,
    kind: Literal["k", "v"],
    action: Action,
    reason: str,
    *,
    fmt: str | None = None,
    scheme: type[Scheme] | None = None,
    scale: torch.Tensor | None = None,
) -> ScaleRecord:
    granularity = None if scheme is None else scheme.name
    if raw is None:
        return ScaleRecord(layer, kind, action, reason, granularity=granularity)
    stats = _raw_stats(raw)
    return ScaleRecord(
        layer=layer,
        kind=kind,
        action=action,
        reason=reason,
        tensor=raw.name,
        convention=raw.convention,
        format=fmt,
        granularity=granularity,
        raw_shape=stats.shape,
        raw_dtype=stats.dtype,
        raw_min=stats.low,
        raw_max=stats.high,
        scale=tuple(float(x) for x in scale.reshape(-1)) if scale is not None else None,
        pre_rope=raw.pre_rope,
        merged_kv=raw.merged_kv,
    )


def _shape_error(raw: RawScale, geometry: LayerGeometry, registry: ScaleFormatRegistry) -> str:
    shape = tuple(int(s) for s in raw.tensor.shape)
    primary: list[tuple[int, ...]] = []
    for fmt in registry.formats():
        if fmt.dynamic:
            continue
        try:
            fmt.check_geometry(geometry)
        except ScaleFormatError:
            continue
        first = fmt.raw_shapes(geometry)[:1]
        primary.extend(first)
    everything = registry.expected_shapes(geometry)
    extra = [s for s in everything if s not in primary]
    also = f" (also read: {format_shapes(extra)})" if extra else ""
    heads = geometry.num_kv_heads
    is_query_vector = (
        len(shape) >= 1 and shape[0] == geometry.num_heads and all(d == 1 for d in shape[1:])
    )
    if is_query_vector:
        fix = (
            "Fix: export per-KV-head scales, or "
            'patch(model, scale_format="per-tensor") to reduce with max.'
        )
    else:
        fix = (
            "Fix: export per-tensor or per-KV-head scales, or register a format that reads "
            "this layout with kvquant.register_scale_format (see kvquant.ScaleFormat)."
        )
    return (
        f"{raw.name} has shape {format_shape(shape)} but the layer has {heads} KV head"
        f"{'s' if heads != 1 else ''}; expected {format_shapes(primary)}{also}. {fix}"
    )


@dataclass
class RawRead:
    """One raw tensor after its format normalised it."""

    raw: RawScale
    fmt: ScaleFormat
    tensor: torch.Tensor
    steps: list[str]


def _read_raw(
    raw: RawScale,
    geometry: LayerGeometry,
    reader: ScaleFormat | None,
    target: type[Scheme] | None,
    registry: ScaleFormatRegistry,
) -> RawRead:
    """Pick the format for one raw tensor and normalise it (raises ScaleFormatError)."""
    cast_note = check_dtype(raw)
    steps = [f"cast {dtype_name(raw.tensor.dtype)} to float32"] if cast_note else []
    if reader is not None:
        fmt = reader
    else:
        candidates = list(registry.detect(raw.tensor.shape, geometry))
        if target is not None and target.scale_shape(geometry.num_kv_heads) == ():
            by_query_heads = QueryHeadMaxFormat()
            if by_query_heads.recognizes(raw.tensor.shape, geometry):
                candidates.append(by_query_heads)
        if not candidates:
            raise ScaleFormatError(_shape_error(raw, geometry, registry))
        fmt = candidates[0]
    tensor = fmt.normalize(raw, geometry)
    if fmt.name not in BUILTIN_NAMES:
        steps.append(f"converted by format {fmt.name!r}")
    if isinstance(fmt, QueryHeadMaxFormat):
        steps.append(f"reduced {geometry.num_heads} query-head scales with max")
    return RawRead(raw, fmt, tensor, steps)


@dataclass
class LayerReads:
    """Per layer: the K/V reads, the raw pair, problems and notes found while reading."""

    reads: dict[int, tuple[RawRead | None, RawRead | None]]
    pairs: dict[int, tuple[RawScale | None, RawScale | None]]
    problems: dict[int, list[str]]
    notes: dict[int, list[str]]


def read_layers(
    by_layer: Mapping[int, list[RawScale]],
    geometry: LayerGeometry,
    reader: ScaleFormat | None,
    target: type[Scheme] | None,
    registry: ScaleFormatRegistry,
    missing_kv: str,
    events: dict[tuple[Conversion, str], list[int]],
) -> LayerReads:
    """Pair each layer's K and V and read every raw tensor once (a shared kv_scale once)."""
    layer_reads: dict[int, tuple[RawRead | None, RawRead | None]] = {}
    layer_problems: dict[int, list[str]] = {}
    layer_notes: dict[int, list[str]] = {}
    pairs: dict[int, tuple[RawScale | None, RawScale | None]] = {}
    for layer, raws in sorted(by_layer.items()):
        mine: list[str] = []
        notes: list[str] = []
        try:
            pair = pair_kv(layer, raws, missing_kv)
            k_raw: RawScale | None = pair.k
            v_raw: RawScale | None = pair.v
            notes.extend(pair.notes)
            if pair.k is pair.v:
                key = (
                    (Conversion.KV_SCALE_SHARED, "one kv_scale serves K and V")
                    if pair.k.kind == "kv"
                    else (Conversion.KV_REUSED, 'K and V share one scale (missing_kv="reuse")')
                )
                events.setdefault(key, []).append(layer)
        except ScaleFormatError as exc:
            mine.append(str(exc))
            kinds = {r.kind: r for r in raws}
            k_raw = kinds.get("k", kinds.get("kv"))
            v_raw = kinds.get("v", kinds.get("kv"))
        pairs[layer] = (k_raw, v_raw)
        done: dict[int, RawRead | None] = {}
        for side in (k_raw, v_raw):
            if side is None or id(side) in done:
                continue
            try:
                done[id(side)] = _read_raw(side, geometry.layer(layer), reader, target, registry)
            except ScaleFormatError as exc:
                done[id(side)] = None
                mine.append(str(exc))
        layer_reads[layer] = (
            done.get(id(k_raw)) if k_raw is not None else None,
            done.get(id(v_raw)) if v_raw is not None else None,
        )
        layer_problems[layer] = mine
        layer_notes[layer] = notes

    return LayerReads(reads=layer_reads, pairs=pairs, problems=layer_problems, notes=layer_notes)

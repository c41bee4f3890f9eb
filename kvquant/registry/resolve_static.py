"""Resolution of static formats (per-tensor, per-head, the k-transform): the conversions of
each layer's scales into the canonical fp32 form, or the problems that reject them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch

from kvquant.errors import ScaleFormatError
from kvquant.registry.conversions import Conversion
from kvquant.registry.formats import QueryHeadMaxFormat, ScaleFormat
from kvquant.registry.policy import (
    apply_rope_policy,
    broadcast_to_per_head,
    check_offset,
    check_rotation,
    check_values,
    reduce_to_per_tensor,
)
from kvquant.registry.registry import (
    ScaleFormatRegistry,
)
from kvquant.registry.resolve_dynamic import no_scales
from kvquant.registry.resolve_reading import LayerReads, RawRead, read_layers, record_of
from kvquant.registry.resolve_results import (
    Action,
    LayerScales,
    ModelScales,
    dtype_name,
    layers_phrase,
    summarise,
)
from kvquant.schemes import PerHeadScales, PerTensorScales, Scheme
from kvquant.types import (
    MAX_FIRST_TOKENS,
    KTransform,
    LayerGeometry,
    RawKTransform,
    RawScale,
)

__all__ = [
    "analyze_static",
    "with_k_transform",
]


def with_k_transform(
    scales: ModelScales, k_transform: RawKTransform | None, geometry: LayerGeometry
) -> ModelScales:
    """Attach the K offsets and settings to resolved k-transform scales, recording every problem."""
    if k_transform is None:
        problem = (
            'scale_format="k-transform" needs a K transform (per-channel K offsets and '
            "kvquant_kv_transform.json) but none was found. Fix: point scales= at a checkpoint "
            "folder written by kvquant calibrate with the k-transform format, or pick another "
            "scale_format."
        )
        return dataclasses.replace(scales, problems=(*scales.problems, problem))
    if not isinstance(k_transform, RawKTransform):
        raise ScaleFormatError(
            f"k_transform is a {type(k_transform).__name__}; expected kvquant.registry."
            "RawKTransform. Fix: build it with kvquant's discovery (discover_scales)."
        )
    where = k_transform.source or "the K transform"
    settings = k_transform.settings
    problems = list(scales.problems)
    model_problems: list[str] = []
    try:
        check_rotation(settings.rotation, geometry.head_dim, where)
    except ScaleFormatError as exc:
        model_problems.append(str(exc))
    first = settings.first_tokens
    if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first <= MAX_FIRST_TOKENS:
        model_problems.append(
            f"{where}: first_tokens is {first!r}; expected an int from 0 to {MAX_FIRST_TOKENS}. "
            "Fix: correct first_tokens (1 keeps the attention sink at full precision)."
        )
    offsets: dict[int, list[Any]] = {}
    for raw in k_transform.offsets:
        if isinstance(raw.layer, int) and 0 <= raw.layer < geometry.num_layers:
            offsets.setdefault(raw.layer, []).append(raw)
        else:
            model_problems.append(
                f"{raw.name} is for layer {raw.layer!r} but the model has {geometry.num_layers} "
                f"layers (0-{geometry.num_layers - 1}). Fix: check that the K transform belongs "
                "to this model."
            )
    layers = []
    for layer_scales in scales.layers:
        layer, mine = _layer_with_offset(
            layer_scales, offsets.get(layer_scales.layer, []), geometry
        )
        problems.extend(mine)
        layers.append(layer)
    note = (
        f"K transform from {where}: per-channel K offsets, rotation "
        f"{settings.rotation or 'none'}, first {settings.first_tokens} token(s) of each sequence "
        "at full precision"
    )
    return dataclasses.replace(
        scales,
        layers=tuple(layers),
        problems=(*model_problems, *problems),
        notes=(*scales.notes, note),
        k_transform=KTransform(rotation=settings.rotation, first_tokens=settings.first_tokens),
    )


def _layer_with_offset(
    layer_scales: LayerScales, found: list[Any], geometry: LayerGeometry
) -> tuple[LayerScales, list[str]]:
    """One layer's scales joined with its K offset (``found``: the offsets named for it), and
    the problems that reject the layer (a missing, repeated or bad offset)."""
    mine: list[str] = []
    offset = None
    name = found[0].name if found else None
    if not found:
        mine.append(
            f"layer {layer_scales.layer} has no k_offset (expected "
            f"model.layers.{layer_scales.layer}.self_attn.k_offset, fp32 "
            f"[{geometry.num_kv_heads}, {geometry.head_dim}]). Fix: re-run kvquant calibrate "
            'for this model, or patch(model, scale_format="fp32-group").'
        )
    elif len(found) > 1:
        mine.append(
            f"layer {layer_scales.layer} has {len(found)} k_offset tensors "
            f"({', '.join(r.name for r in found[:3])}). Fix: keep one per layer."
        )
    else:
        try:
            offset = check_offset(found[0], geometry)
        except ScaleFormatError as exc:
            mine.append(str(exc))
    ok = layer_scales.ok and not mine
    k_record, v_record = layer_scales.k_record, layer_scales.v_record
    if mine and layer_scales.ok:
        k_record = dataclasses.replace(
            k_record, action="reject", reason=" | ".join(mine), scale=None
        )
        v_record = dataclasses.replace(
            v_record,
            action="reject",
            reason=(
                f"this V scale is fine on its own; layer {layer_scales.layer} is rejected "
                "because of its K offset (see the K row)"
            ),
            scale=None,
        )
    return (
        dataclasses.replace(
            layer_scales,
            k_record=k_record,
            v_record=v_record,
            k=layer_scales.k if ok else None,
            v=layer_scales.v if ok else None,
            k_offset=offset if ok else None,
            k_offset_tensor=name,
            problems=(*layer_scales.problems, *mine),
        ),
        mine,
    )


def analyze_static(
    raw_scales: Sequence[RawScale],
    geometry: LayerGeometry,
    reader: ScaleFormat | None,
    target: type[Scheme] | None,
    requested: ScaleFormat | None,
    group_size: int | None,
    missing_scales: str,
    missing_kv: str,
    rope_policy: str,
    registry: ScaleFormatRegistry,
    recorded: dict[str, Any],
) -> ModelScales:
    """The static part of :func:`analyze_scales`: read, pair, convert and check every layer."""

    problems: list[str] = []
    by_layer = _by_layer(raw_scales, geometry, problems)

    if not by_layer:
        return no_scales(
            geometry, group_size, recorded, missing_scales, requested, target, problems
        )

    events: dict[tuple[Conversion, str], list[int]] = {}
    reads = read_layers(by_layer, geometry, reader, target, registry, missing_kv, events)
    missing = [i for i in range(geometry.num_layers) if i not in by_layer]
    if missing:
        present = sorted(by_layer)
        example = by_layer[present[0]][0].name
        problems.append(
            f"{layers_phrase(missing)} no KV scales but {layers_phrase(present, 'do')} "
            f"(e.g. {example}); expected scales for all "
            f"{geometry.num_layers} layers. Fix: re-export the checkpoint with KV scales for "
            'every layer, or patch(model, scale_format="fp32-group") to ignore them and '
            "compute scales while writing the cache."
        )

    # The model-wide scheme: requested, or per-head if any layer has per-head scales.
    if target is None:
        per_head = any(
            read.tensor.dim() == 1
            for layer_pair in reads.reads.values()
            for read in layer_pair
            if read is not None
        )
        target = PerHeadScales if per_head else PerTensorScales

    reductions: list[tuple[int, float]] = []
    layers: list[LayerScales] = []
    for layer in range(geometry.num_layers):
        if layer not in by_layer:
            layers.append(_layer_without_scales(layer, target))
            continue
        layers.append(
            _finish_layer(layer, reads, target, geometry, rope_policy, events, reductions)
        )
        problems.extend(layers[-1].problems)

    applied, model_notes = summarise(events, reductions, layers)
    return ModelScales(
        geometry=geometry,
        scheme=target,
        group_size=None,
        layers=tuple(layers),
        notes=tuple(model_notes),
        problems=tuple(problems),
        options=recorded,
        conversions=tuple(applied),
    )


def _by_layer(
    raw_scales: Sequence[RawScale], geometry: LayerGeometry, problems: list[str]
) -> dict[int, list[RawScale]]:
    """The raw scales grouped by layer; one with a bad layer index goes to ``problems``."""
    by_layer: dict[int, list[RawScale]] = {}
    for raw in raw_scales:
        if not isinstance(raw, RawScale):
            raise ScaleFormatError(
                f"raw_scales holds a {type(raw).__name__}; expected kvquant.registry.RawScale. "
                "Fix: build them with kvquant's discovery (discover_scales or "
                "raw_scales_from_state_dict)."
            )
        if isinstance(raw.layer, bool) or not isinstance(raw.layer, int):
            problems.append(
                f"{raw.name} has layer index {raw.layer!r}; expected an int. "
                "Fix: build RawScale objects with kvquant's discovery."
            )
        elif not 0 <= raw.layer < geometry.num_layers:
            problems.append(
                f"{raw.name} is for layer {raw.layer} but the model has {geometry.num_layers} "
                f"layers (0-{geometry.num_layers - 1}). Fix: check that the checkpoint belongs "
                "to this model (num_hidden_layers in config.json)."
            )
        else:
            by_layer.setdefault(raw.layer, []).append(raw)
    return by_layer


def _layer_without_scales(layer: int, target: type[Scheme]) -> LayerScales:
    """A layer with no scale while other layers have them: rejected."""
    reason = "no KV scale for this layer (other layers have them)"
    return LayerScales(
        layer=layer,
        scheme=target,
        k=None,
        v=None,
        group_size=None,
        source="none",
        k_record=record_of(None, layer, "k", "reject", reason, scheme=target),
        v_record=record_of(None, layer, "v", "reject", reason, scheme=target),
        problems=(f"layer {layer} has no KV scales",),
    )


def _event(
    events: dict[tuple[Conversion, str], list[int]], conversion: Conversion, text: str, layer: int
) -> None:
    """Record that ``layer`` went through ``conversion`` (``text`` says it in the summary)."""
    events.setdefault((conversion, text), []).append(layer)


def _convert_read(
    layer: int,
    kind: str,
    read: RawRead,
    target: type[Scheme],
    geometry: LayerGeometry,
    rope_policy: str,
    events: dict[tuple[Conversion, str], list[int]],
    reductions: list[tuple[int, float]],
    notes: list[str],
) -> tuple[torch.Tensor, list[str]]:
    """One cache's read converted to ``target`` (granularity, RoPE policy): tensor and steps."""
    tensor = read.tensor
    steps = list(read.steps)
    if isinstance(read.fmt, QueryHeadMaxFormat):
        _event(
            events,
            Conversion.QUERY_HEAD_MAX,
            'query-head scales reduced to per-tensor with max (scale_format="per-tensor")',
            layer,
        )
    want = target.scale_shape(geometry.kv_heads_of(layer))
    if want == () and tensor.dim() == 1:
        tensor, ratio = reduce_to_per_tensor(tensor)
        reductions.append((layer, ratio))
        steps.append(f"reduced per-head to per-tensor with max (max/min {ratio:.3g})")
        _event(
            events,
            Conversion.PER_HEAD_MAX,
            'per-head scales reduced to per-tensor with max (scale_format="per-tensor")',
            layer,
        )
    elif want and tensor.dim() == 0:
        tensor = broadcast_to_per_head(tensor, geometry.kv_heads_of(layer))
        steps.append("per-tensor broadcast to every KV head (lossless)")
        _event(
            events,
            Conversion.BROADCAST_PER_HEAD,
            "per-tensor scales broadcast to per-head (lossless)",
            layer,
        )
    if kind == "k" and read.raw.pre_rope:
        tensor, note = apply_rope_policy(tensor, read.raw, rope_policy)
        notes.append(note)
        if rope_policy == "widen":
            steps.append("widened by sqrt(2): calibrated before RoPE")
            _event(
                events,
                Conversion.ROPE_WIDENED,
                "K calibrated before RoPE, widened by sqrt(2) (rope_policy='widen')",
                layer,
            )
        else:
            _event(
                events,
                Conversion.ROPE_KEPT,
                "K calibrated before RoPE, kept, may saturate (rope_policy='keep')",
                layer,
            )
    if read.steps and read.steps[0].startswith("cast "):
        _event(
            events,
            Conversion.CAST,
            f"{dtype_name(read.raw.tensor.dtype)} scales cast to float32",
            layer,
        )
    return tensor, steps


def _note_kv_relation(
    layer: int,
    k_read: RawRead,
    v_read: RawRead,
    notes: list[str],
    events: dict[tuple[Conversion, str], list[int]],
) -> None:
    """Note K and V scales that are one tensor, one merged value or identical."""
    if k_read.raw is v_read.raw:
        return  # one tensor for both caches: already noted by pair_kv
    if k_read.raw.merged_kv or v_read.raw.merged_kv:
        notes.append(
            f"layer {layer}: the producer stores max(K, V) in both tensors "
            f"({k_read.raw.convention}); kept as stored"
        )
        _event(events, Conversion.MERGED_KV, "K and V hold one merged max(K, V) value", layer)
    elif torch.equal(k_read.tensor, v_read.tensor):
        notes.append(f"layer {layer}: K and V scales are identical (merged by the producer?)")
        _event(events, Conversion.IDENTICAL_KV, "K and V scales identical", layer)


def _rejection_reason(
    layer: int, kind: str, side: Any, side_read: Any, other_raw: Any, mine: list[str]
) -> str:
    """Why one cache's scale of a rejected layer is rejected.

    A row carries its own tensor's problems; a healthy sibling says why it is rejected with
    its layer instead of repeating the other row's reason.
    """
    own = [p for p in mine if side is None or side.name in p]
    other = "V" if kind == "k" else "K"
    blamed = other_raw is not None and any(other_raw.name in p for p in mine)
    if side_read is not None and not own and blamed:
        reason = (
            f"this {kind.upper()} scale is fine on its own; layer {layer} is "
            f"rejected because of its {other} scale (see the {other} row)"
        )
    else:
        reason = " | ".join(own or mine)
    return f"no {kind.upper()} scale; " + reason if side is None else reason


def _accepted_steps(kind: str, side: Any, steps: list[str]) -> list[str]:
    """An accepted cache's steps, led by how its raw tensor relates to the cache."""
    if side is not None and side.kind == "kv":
        return ["one kv_scale for K and V", *steps]
    if side is not None and side.kind != kind:
        return [f"{side.kind.upper()} scale reused (missing_kv='reuse')", *steps]
    return steps


def _finish_layer(
    layer: int,
    reads: LayerReads,
    target: type[Scheme],
    geometry: LayerGeometry,
    rope_policy: str,
    events: dict[tuple[Conversion, str], list[int]],
    reductions: list[tuple[int, float]],
) -> LayerScales:
    """Convert one layer's reads to the target granularity, check them, and record what was done."""
    k_read, v_read = reads.reads[layer]
    k_raw, v_raw = reads.pairs[layer]
    mine = reads.problems[layer]
    notes = reads.notes[layer]
    finals: dict[str, torch.Tensor] = {}
    steps: dict[str, list[str]] = {}
    if not mine and k_read is not None and v_read is not None:
        for kind, read in (("k", k_read), ("v", v_read)):
            tensor, steps[kind] = _convert_read(
                layer, kind, read, target, geometry, rope_policy, events, reductions, notes
            )
            try:
                check_values(tensor, read.raw.name, stage="after conversion")
            except ScaleFormatError as exc:
                mine.append(str(exc))
            finals[kind] = tensor.clone()  # K and V never share storage
        _note_kv_relation(layer, k_read, v_read, notes, events)
    ok = not mine
    sources = sorted({r.convention for r in (k_raw, v_raw) if r is not None})
    records = []
    for kind, side, side_read, other_raw in (
        ("k", k_raw, k_read, v_raw),
        ("v", v_raw, v_read, k_raw),
    ):
        kind_lit: Literal["k", "v"] = "k" if kind == "k" else "v"
        fmt_name = side_read.fmt.name if side_read is not None else None
        if ok:
            kind_steps = _accepted_steps(kind, side, steps[kind])
            action: Action = "convert" if kind_steps else "use"
            reason = "; ".join(kind_steps) if kind_steps else "used as stored"
            records.append(
                record_of(
                    side,
                    layer,
                    kind_lit,
                    action,
                    reason,
                    fmt=fmt_name,
                    scheme=target,
                    scale=finals[kind],
                )
            )
        else:
            reason = _rejection_reason(layer, kind, side, side_read, other_raw, mine)
            records.append(
                record_of(side, layer, kind_lit, "reject", reason, fmt=fmt_name, scheme=target)
            )
    return LayerScales(
        layer=layer,
        scheme=target,
        k=finals["k"] if ok else None,
        v=finals["v"] if ok else None,
        group_size=None,
        source="+".join(sources) if sources else "none",
        k_record=records[0],
        v_record=records[1],
        notes=tuple(notes),
        problems=tuple(mine),
    )

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

import dataclasses
import logging
import math
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvquant.errors import OptionError, OptionTypeError, ScaleFormatError
from kvquant.registry.conversions import AppliedConversion, Conversion
from kvquant.registry.formats import QueryHeadMaxFormat, ScaleFormat
from kvquant.registry.options import ResolveOptions
from kvquant.registry.policy import (
    MISSING_KV_POLICIES,
    MISSING_SCALES_POLICIES,
    ROPE_POLICIES,
    apply_rope_policy,
    broadcast_to_per_head,
    check_dtype,
    check_geometry,
    check_offset,
    check_rotation,
    check_values,
    format_layers,
    format_shape,
    format_shapes,
    model_group_size,
    pair_kv,
    reduce_to_per_tensor,
)
from kvquant.registry.registry import (
    BUILTIN_FORMATS,
    ScaleFormatRegistry,
    check_format_contract,
    default_registry,
)
from kvquant.types import (
    MAX_FIRST_TOKENS,
    Granularity,
    KTransform,
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

Action = Literal["use", "convert", "reject", "ignore", "default"]
"""What kvquant does with one cache's scale in one layer.

* ``use``: the checkpoint value as stored (fp32, canonical after a reshape);
* ``convert``: the checkpoint value after a dtype cast, a format conversion,
  a broadcast, a max-reduction or a RoPE widening (``reason`` lists them);
* ``reject``: the scale (or its absence) is a problem; see ``reason``;
* ``ignore``: a checkpoint scale exists but ``fp32-group`` was chosen;
* ``default``: no checkpoint scale; dynamic fp32-group or 1.0 (``missing_scales``).
"""

_MAX_LISTED_PROBLEMS = 10
_BUILTIN_NAMES = frozenset(f.name for f in BUILTIN_FORMATS)


def _json_float(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


@dataclass(frozen=True)
class ScaleRecord:
    """What happened to one cache's (K or V) scale in one layer: one row of the doctor's table.

    Attributes:
        layer: decoder layer index.
        kind: ``"k"`` or ``"v"``.
        action: see :data:`Action`.
        reason: why, in words (the steps taken, or the problem).
        tensor: checkpoint tensor name, ``None`` when there is none.
        convention: producer convention of that tensor (``"compressed-tensors"``, ...).
        format: name of the format that read it (``"per-head"``, a user format, ...).
        granularity: the canonical granularity the layer ends up with.
        raw_shape: shape as stored.
        raw_dtype: dtype as stored, e.g. ``"bfloat16"``.
        raw_min: smallest raw value (NaN if any is NaN), ``None`` if unreadable.
        raw_max: largest raw value (NaN if any is NaN), ``None`` if unreadable.
        scale: the canonical fp32 value(s) kvquant uses, ``None`` when none.
        pre_rope: the producer calibrated K before RoPE.
        merged_kv: the producer stores ``max(K, V)`` in both tensors.
    """

    layer: int
    kind: Literal["k", "v"]
    action: Action
    reason: str
    tensor: str | None = None
    convention: str | None = None
    format: str | None = None
    granularity: str | None = None
    raw_shape: tuple[int, ...] | None = None
    raw_dtype: str | None = None
    raw_min: float | None = None
    raw_max: float | None = None
    scale: tuple[float, ...] | None = None
    pre_rope: bool = False
    merged_kv: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (non-finite floats as ``"nan"``, ``"inf"``, ``"-inf"``)."""
        return {
            "layer": self.layer,
            "kind": self.kind,
            "action": self.action,
            "reason": self.reason,
            "tensor": self.tensor,
            "convention": self.convention,
            "format": self.format,
            "granularity": self.granularity,
            "raw_shape": list(self.raw_shape) if self.raw_shape is not None else None,
            "raw_dtype": self.raw_dtype,
            "raw_min": _json_float(self.raw_min),
            "raw_max": _json_float(self.raw_max),
            "scale": [_json_float(v) for v in self.scale] if self.scale is not None else None,
            "pre_rope": self.pre_rope,
            "merged_kv": self.merged_kv,
        }


@dataclass(frozen=True, eq=False)
class LayerScales:
    """The canonical scales of one decoder layer.

    Attributes:
        layer: decoder layer index.
        granularity: ``"per-tensor"``, ``"per-head"`` or ``"fp32-group"``.
        k: fp32 ``[]`` or ``[num_kv_heads]``; ``None`` for fp32-group or a rejected layer.
        v: same as ``k``, for V.
        group_size: ``G`` for fp32-group, else ``None``.
        source: producer convention(s) of the scales used, ``"dynamic"`` or ``"unit"``.
        k_record: what happened to K (a doctor row).
        v_record: what happened to V.
        notes: what kvquant did here beyond reading the value as stored.
        problems: why this layer is rejected; empty when it is fine.
        k_offset: fp32 ``[num_kv_heads, head_dim]`` per-channel K offset (in the
            rotated frame) for ``k-transform``, else ``None``.
        k_offset_tensor: the checkpoint name of that offset, else ``None``.
    """

    layer: int
    granularity: Granularity
    k: torch.Tensor | None
    v: torch.Tensor | None
    group_size: int | None
    source: str
    k_record: ScaleRecord
    v_record: ScaleRecord
    notes: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    k_offset: torch.Tensor | None = None
    k_offset_tensor: str | None = None

    @property
    def ok(self) -> bool:
        """True when the layer has usable scales."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict of the layer."""
        return {
            "layer": self.layer,
            "granularity": self.granularity,
            "group_size": self.group_size,
            "source": self.source,
            "ok": self.ok,
            "k": self.k_record.to_dict(),
            "v": self.v_record.to_dict(),
            "k_offset": _offset_summary(self.k_offset, self.k_offset_tensor),
            "notes": list(self.notes),
            "problems": list(self.problems),
        }


def _offset_summary(offset: torch.Tensor | None, name: str | None) -> dict[str, Any] | None:
    """Name, shape and value range of a K offset, for reports (never the values themselves)."""
    if offset is None and name is None:
        return None
    out: dict[str, Any] = {"tensor": name}
    if offset is not None:
        out["shape"] = list(offset.shape)
        out["min"] = _json_float(float(offset.min()))
        out["max"] = _json_float(float(offset.max()))
        out["mean_abs"] = _json_float(float(offset.abs().mean()))
    return out


@dataclass(frozen=True, eq=False)
class ModelScales:
    """Canonical scales for every layer of a model, plus the report of how they were obtained.

    Attributes:
        geometry: the attention geometry they were resolved for.
        granularity: the granularity every layer uses.
        group_size: ``G`` when ``granularity == "fp32-group"``, else ``None``.
        layers: one :class:`LayerScales` per decoder layer, in order.
        notes: model-level summary of conversions and defaults (one line each).
        problems: every problem found (model-level and per layer); empty when usable.
        options: the options resolution ran with (scale_format, missing_scales, ...).
        conversions: every conversion applied, typed (:class:`AppliedConversion`:
            what, whether it is lossy, the note, the layers); their notes are in
            :attr:`notes`.
        k_transform: the rotation and first-token settings when ``granularity``
            is ``"k-transform"`` (the offsets are per layer), else ``None``.
    """

    geometry: LayerGeometry
    granularity: Granularity
    group_size: int | None
    layers: tuple[LayerScales, ...]
    notes: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    conversions: tuple[AppliedConversion, ...] = ()
    k_transform: KTransform | None = None

    @property
    def ok(self) -> bool:
        """True when every layer has usable scales."""
        return not self.problems

    @property
    def records(self) -> tuple[ScaleRecord, ...]:
        """All doctor rows: K then V for each layer."""
        return tuple(r for layer in self.layers for r in (layer.k_record, layer.v_record))

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[LayerScales]:
        return iter(self.layers)

    def __getitem__(self, layer: int) -> LayerScales:
        return self.layers[layer]

    def raise_for_problems(self) -> None:
        """Raise one :class:`ScaleFormatError` listing the problems, if there are any.

        One problem: its message as is. Several: a count, the first ten, and how
        many more.
        """
        if not self.problems:
            return
        if len(self.problems) == 1:
            raise ScaleFormatError(self.problems[0])
        shown = self.problems[:_MAX_LISTED_PROBLEMS]
        lines = [f"{len(self.problems)} problems with the checkpoint's KV scales:"]
        lines += [f"  {i}. {p}" for i, p in enumerate(shown, 1)]
        if len(self.problems) > len(shown):
            lines.append(
                f"  ... and {len(self.problems) - len(shown)} more "
                "(kvquant.registry.analyze_scales() or `kvquant doctor` lists every layer)."
            )
        raise ScaleFormatError("\n".join(lines))

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict: geometry, options, granularity, notes, problems, layers."""
        return {
            "ok": self.ok,
            "geometry": {
                "num_layers": self.geometry.num_layers,
                "num_heads": self.geometry.num_heads,
                "num_kv_heads": self.geometry.num_kv_heads,
                "head_dim": self.geometry.head_dim,
                **(
                    {}
                    if self.geometry.uniform
                    else {
                        "layer_num_kv_heads": [
                            self.geometry.kv_heads_of(i) for i in range(self.geometry.num_layers)
                        ],
                        "layer_head_dims": [
                            self.geometry.head_dim_of(i) for i in range(self.geometry.num_layers)
                        ],
                    }
                ),
            },
            "options": dict(self.options),
            "granularity": self.granularity,
            "group_size": self.group_size,
            "k_transform": (
                None
                if self.k_transform is None
                else {
                    "rotation": self.k_transform.rotation,
                    "first_tokens": self.k_transform.first_tokens,
                }
            ),
            "notes": list(self.notes),
            "conversions": [
                {
                    "conversion": c.conversion.value,
                    "lossy": c.lossy,
                    "layers": list(c.layers),
                    "note": c.note,
                }
                for c in self.conversions
            ],
            "problems": list(self.problems),
            "layers": [layer.to_dict() for layer in self.layers],
        }

    def report(self) -> str:
        """A short human-readable summary (the doctor renders the full table from :attr:`records`)."""
        g = self.geometry
        head = (
            f"KV scales: {self.granularity}"
            + (f" (G={self.group_size})" if self.group_size else "")
            + (
                f" (rotation {self.k_transform.rotation or 'none'}, first_tokens "
                f"{self.k_transform.first_tokens})"
                if self.k_transform is not None
                else ""
            )
            + f" for {len(self.layers)} layers ({g.num_heads} heads, {g.describe()}): "
            f"{'ok' if self.ok else 'REJECTED'}"
        )
        lines = [head]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines)


def _layers_phrase(layers: Sequence[int], verb: str = "have") -> str:
    """``"layer 3 has"`` / ``"layers 4-7, 9 have"`` (``verb`` "do" gives "does" / "do")."""
    single = {"have": "has", "do": "does"}[verb]
    if len(layers) == 1:
        return f"layer {layers[0]} {single}"
    return f"layers {format_layers(layers)} {verb}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
    stats = _Stats(shape=tuple(int(s) for s in tensor.shape), dtype=_dtype_name(tensor.dtype))
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


def _record(
    raw: RawScale | None,
    layer: int,
    kind: Literal["k", "v"],
    action: Action,
    reason: str,
    *,
    fmt: str | None = None,
    granularity: str | None = None,
    scale: torch.Tensor | None = None,
) -> ScaleRecord:
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
class _Read:
    """One raw tensor after its format normalised it."""

    raw: RawScale
    fmt: ScaleFormat
    tensor: torch.Tensor
    steps: list[str]


def _read_raw(
    raw: RawScale,
    geometry: LayerGeometry,
    reader: ScaleFormat | None,
    target: Granularity | None,
    registry: ScaleFormatRegistry,
) -> _Read:
    """Pick the format for one raw tensor and normalise it (raises ScaleFormatError)."""
    cast_note = check_dtype(raw)
    steps = [f"cast {_dtype_name(raw.tensor.dtype)} to float32"] if cast_note else []
    if reader is not None:
        fmt = reader
    else:
        candidates = list(registry.detect(raw.tensor.shape, geometry))
        if target == "per-tensor":
            by_query_heads = QueryHeadMaxFormat()
            if by_query_heads.recognizes(raw.tensor.shape, geometry):
                candidates.append(by_query_heads)
        if not candidates:
            raise ScaleFormatError(_shape_error(raw, geometry, registry))
        fmt = candidates[0]
    tensor = fmt.normalize(raw, geometry)
    if fmt.name not in _BUILTIN_NAMES:
        steps.append(f"converted by format {fmt.name!r}")
    if isinstance(fmt, QueryHeadMaxFormat):
        steps.append(f"reduced {geometry.num_heads} query-head scales with max")
    return _Read(raw, fmt, tensor, steps)


def _validate_options(
    scale_format: str | ScaleFormat,
    missing_scales: str,
    missing_kv: str,
    rope_policy: str,
    registry: ScaleFormatRegistry,
) -> ScaleFormat | None:
    for value, allowed, option in (
        (missing_scales, MISSING_SCALES_POLICIES, "missing_scales"),
        (missing_kv, MISSING_KV_POLICIES, "missing_kv"),
        (rope_policy, ROPE_POLICIES, "rope_policy"),
    ):
        if value not in allowed:
            raise ScaleFormatError(
                f"{option}={value!r} is not a policy; expected one of "
                f"{', '.join(map(repr, allowed))}. Fix: pass one of those."
            )
    if isinstance(scale_format, ScaleFormat):
        check_format_contract(scale_format)
        return scale_format
    if isinstance(scale_format, type) and issubclass(scale_format, ScaleFormat):
        raise ScaleFormatError(
            f"scale_format is the class {scale_format.__qualname__}; expected a format name or "
            f"an instance. Fix: pass scale_format={scale_format.__qualname__}()."
        )
    if scale_format == "auto":
        return None
    return registry.get(scale_format)


def _check_argument_types(
    raw_scales: Any, geometry: Any, options: Any, k_transform: Any
) -> list[RawScale]:
    """The raw scales as a list, after checking every argument's type (OptionTypeError)."""
    if not isinstance(geometry, LayerGeometry):
        raise OptionTypeError(
            f"resolve_scales: geometry is a {type(geometry).__name__}; expected a "
            "kvquant.LayerGeometry. Fix: pass LayerGeometry(num_layers, num_heads, num_kv_heads, "
            "head_dim), or discover_scales(path).geometry."
        )
    if isinstance(raw_scales, (str, bytes, Mapping)) or not isinstance(raw_scales, Iterable):
        raise OptionTypeError(
            f"resolve_scales: raw_scales is a {type(raw_scales).__name__}; expected a sequence "
            "of kvquant.RawScale (discover_scales(path).scales). Fix: pass a list of RawScale; "
            "for a {tensor_name: tensor} mapping, use kvquant.patch(model, scales=mapping)."
        )
    listed = list(raw_scales)  # each element is checked where it is read (ScaleFormatError)
    if options is not None and not isinstance(options, ResolveOptions):
        raise OptionTypeError(
            f"resolve_scales: options is a {type(options).__name__}; expected a "
            "kvquant.ResolveOptions or None."
        )
    if k_transform is not None and not isinstance(k_transform, RawKTransform):
        raise OptionTypeError(
            f"resolve_scales: k_transform is a {type(k_transform).__name__}; expected "
            "discover_scales(path).k_transform (a RawKTransform) or None."
        )
    return listed


def analyze_scales(
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
    """Normalise every raw scale and record, per layer, what was done or what is wrong.

    Never raises for scale contents: check :attr:`ModelScales.ok` and
    :attr:`ModelScales.problems`. Arguments as in :func:`resolve_scales`.

    Raises:
        ScaleFormatError: an option value is not a policy, or the geometry is impossible.
        UnknownFormatError: ``scale_format`` names no registered format.
        FormatRegistrationError: ``scale_format`` is a format instance that breaks the contract.
        OptionTypeError: ``raw_scales``, ``geometry``, ``options`` or ``k_transform``
            of the wrong type.
    """
    raw_scales = _check_argument_types(raw_scales, geometry, options, k_transform)
    if options is not None:
        given = ResolveOptions(scale_format, missing_scales, group_size, missing_kv, rope_policy)
        if given != ResolveOptions():
            raise OptionError(
                f"options={options!r} was passed together with individual options ({given!r}); "
                "expected one or the other. Fix: put every option into the ResolveOptions."
            )
        scale_format, missing_scales = options.scale_format, options.missing_scales
        group_size, missing_kv, rope_policy = (
            options.group_size,
            options.missing_kv,
            options.rope_policy,
        )
    registry = registry if registry is not None else default_registry
    check_geometry(geometry)
    requested = _validate_options(scale_format, missing_scales, missing_kv, rope_policy, registry)
    recorded: dict[str, Any] = {
        "scale_format": requested.name if requested is not None else "auto",
        "missing_scales": missing_scales,
        "group_size": group_size,
        "missing_kv": missing_kv,
        "rope_policy": rope_policy,
    }
    if requested is not None and requested.dynamic:
        own = getattr(requested, "group_size", None)
        if group_size is None and isinstance(scale_format, ScaleFormat) and isinstance(own, int):
            group_size = own  # an instance such as Fp32GroupFormat(group_size=32)
        dynamic = _dynamic(
            raw_scales, geometry, group_size, recorded, requested.name, explicit=True, reason=None
        )
        if k_transform is None:
            return dynamic
        note = (
            f'scale_format="{requested.name}": the checkpoint\'s K transform '
            f"({k_transform.source or 'given'}) is ignored; scales are computed while writing"
        )
        return dataclasses.replace(
            dynamic,
            notes=(*dynamic.notes, note),
            conversions=(
                *dynamic.conversions,
                AppliedConversion(
                    Conversion.CHECKPOINT_IGNORED, note, tuple(range(geometry.num_layers))
                ),
            ),
        )
    # A built-in name chooses the target granularity and formats are detected
    # per tensor; a user format reads every tensor itself. A K transform in the
    # checkpoint makes "auto" resolve to the k-transform target.
    reader = requested if requested is not None and requested.name not in _BUILTIN_NAMES else None
    target: Granularity | None = requested.granularity if requested is not None else None
    if target is None and k_transform is not None:
        target = "k-transform"
    result = _analyze_static(
        raw_scales, geometry, reader, target, requested, group_size, missing_scales,
        missing_kv, rope_policy, registry, recorded,
    )  # fmt: skip
    if k_transform is not None and not raw_scales:
        problem = (
            f"{k_transform.source or 'the checkpoint'} declares a K transform but the checkpoint "
            "has no K/V scales; the k-transform format needs static K and V scales for every "
            "layer (model.layers.N.self_attn.k_scale / v_scale). Fix: re-run kvquant calibrate "
            'for this model, or patch(model, scale_format="fp32-group") to ignore the transform.'
        )
        return dataclasses.replace(result, problems=(*result.problems, problem))
    if result.granularity == "k-transform":
        return _with_k_transform(result, k_transform, geometry)
    if k_transform is not None and result.granularity != "fp32-group":
        name = requested.name if requested is not None else "auto"
        problem = (
            f"{k_transform.source or 'the checkpoint'} declares a K transform (per-channel K "
            f'offsets) but scale_format="{name}" resolves {result.granularity} scales without '
            "it; its K scales were calibrated for the offset keys and would saturate on raw "
            'keys. Fix: scale_format="auto" or "k-transform", or "fp32-group" to ignore the '
            "checkpoint's scales."
        )
        return dataclasses.replace(result, problems=(*result.problems, problem))
    return result


def _with_k_transform(
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
        found = offsets.get(layer_scales.layer, [])
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
        problems.extend(mine)
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
        layers.append(
            dataclasses.replace(
                layer_scales,
                k_record=k_record,
                v_record=v_record,
                k=layer_scales.k if ok else None,
                v=layer_scales.v if ok else None,
                k_offset=offset if ok else None,
                k_offset_tensor=name,
                problems=(*layer_scales.problems, *mine),
            )
        )
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


def _analyze_static(
    raw_scales: Sequence[RawScale],
    geometry: LayerGeometry,
    reader: ScaleFormat | None,
    target: Granularity | None,
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

    if not by_layer:
        return _no_scales(
            geometry, group_size, recorded, missing_scales, requested, target, problems
        )

    events: dict[tuple[Conversion, str], list[int]] = {}
    reads = _read_layers(by_layer, geometry, reader, target, registry, missing_kv, events)
    missing = [i for i in range(geometry.num_layers) if i not in by_layer]
    if missing:
        present = sorted(by_layer)
        example = by_layer[present[0]][0].name
        problems.append(
            f"{_layers_phrase(missing)} no KV scales but {_layers_phrase(present, 'do')} "
            f"(e.g. {example}); expected scales for all "
            f"{geometry.num_layers} layers. Fix: re-export the checkpoint with KV scales for "
            'every layer, or patch(model, scale_format="fp32-group") to ignore them and '
            "compute scales while writing the cache."
        )

    # The model-wide granularity: requested, or per-head if any layer has per-head scales.
    if target is None:
        grans = {
            read.fmt.granularity
            for layer_pair in reads.reads.values()
            for read in layer_pair
            if read is not None
        }
        target = "per-head" if "per-head" in grans else "per-tensor"

    reductions: list[tuple[int, float]] = []
    layers: list[LayerScales] = []
    for layer in range(geometry.num_layers):
        if layer not in by_layer:
            reason = "no KV scale for this layer (other layers have them)"
            layers.append(
                LayerScales(
                    layer=layer,
                    granularity=target,
                    k=None,
                    v=None,
                    group_size=None,
                    source="none",
                    k_record=_record(None, layer, "k", "reject", reason, granularity=target),
                    v_record=_record(None, layer, "v", "reject", reason, granularity=target),
                    problems=(f"layer {layer} has no KV scales",),
                )
            )
            continue
        layers.append(
            _finish_layer(layer, reads, target, geometry, rope_policy, events, reductions)
        )
        problems.extend(layers[-1].problems)

    applied, model_notes = _summarise(events, reductions, layers)
    return ModelScales(
        geometry=geometry,
        granularity=target,
        group_size=None,
        layers=tuple(layers),
        notes=tuple(model_notes),
        problems=tuple(problems),
        options=recorded,
        conversions=tuple(applied),
    )


@dataclass
class _LayerReads:
    """Per layer: the K/V reads, the raw pair, problems and notes found while reading."""

    reads: dict[int, tuple[_Read | None, _Read | None]]
    pairs: dict[int, tuple[RawScale | None, RawScale | None]]
    problems: dict[int, list[str]]
    notes: dict[int, list[str]]


def _read_layers(
    by_layer: Mapping[int, list[RawScale]],
    geometry: LayerGeometry,
    reader: ScaleFormat | None,
    target: Granularity | None,
    registry: ScaleFormatRegistry,
    missing_kv: str,
    events: dict[tuple[Conversion, str], list[int]],
) -> _LayerReads:
    """Pair each layer's K and V and read every raw tensor once (a shared kv_scale once)."""
    layer_reads: dict[int, tuple[_Read | None, _Read | None]] = {}
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
        done: dict[int, _Read | None] = {}
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

    return _LayerReads(reads=layer_reads, pairs=pairs, problems=layer_problems, notes=layer_notes)


def _finish_layer(
    layer: int,
    reads: _LayerReads,
    target: Granularity,
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
            tensor = read.tensor
            kind_steps = list(read.steps)
            if isinstance(read.fmt, QueryHeadMaxFormat):
                events.setdefault(
                    (
                        Conversion.QUERY_HEAD_MAX,
                        "query-head scales reduced to per-tensor with max "
                        '(scale_format="per-tensor")',
                    ),
                    [],
                ).append(layer)
            if target == "per-tensor" and tensor.dim() == 1:
                tensor, ratio = reduce_to_per_tensor(tensor)
                reductions.append((layer, ratio))
                kind_steps.append(f"reduced per-head to per-tensor with max (max/min {ratio:.3g})")
                events.setdefault(
                    (
                        Conversion.PER_HEAD_MAX,
                        "per-head scales reduced to per-tensor with max "
                        '(scale_format="per-tensor")',
                    ),
                    [],
                ).append(layer)
            elif target in ("per-head", "k-transform") and tensor.dim() == 0:
                tensor = broadcast_to_per_head(tensor, geometry.kv_heads_of(layer))
                kind_steps.append("per-tensor broadcast to every KV head (lossless)")
                events.setdefault(
                    (
                        Conversion.BROADCAST_PER_HEAD,
                        "per-tensor scales broadcast to per-head (lossless)",
                    ),
                    [],
                ).append(layer)
            if kind == "k" and read.raw.pre_rope:
                tensor, note = apply_rope_policy(tensor, read.raw, rope_policy)
                notes.append(note)
                if rope_policy == "widen":
                    kind_steps.append("widened by sqrt(2): calibrated before RoPE")
                rope_event = (
                    (
                        Conversion.ROPE_WIDENED,
                        "K calibrated before RoPE, widened by sqrt(2) (rope_policy='widen')",
                    )
                    if rope_policy == "widen"
                    else (
                        Conversion.ROPE_KEPT,
                        "K calibrated before RoPE, kept, may saturate (rope_policy='keep')",
                    )
                )
                events.setdefault(rope_event, []).append(layer)
            try:
                check_values(tensor, read.raw.name, stage="after conversion")
            except ScaleFormatError as exc:
                mine.append(str(exc))
            finals[kind] = tensor.clone()  # K and V never share storage
            steps[kind] = kind_steps
            if read.steps and read.steps[0].startswith("cast "):
                events.setdefault(
                    (
                        Conversion.CAST,
                        f"{_dtype_name(read.raw.tensor.dtype)} scales cast to float32",
                    ),
                    [],
                ).append(layer)
        if k_read.raw is v_read.raw:
            pass  # one tensor for both caches: already noted by pair_kv
        elif k_read.raw.merged_kv or v_read.raw.merged_kv:
            notes.append(
                f"layer {layer}: the producer stores max(K, V) in both tensors "
                f"({k_read.raw.convention}); kept as stored"
            )
            events.setdefault(
                (Conversion.MERGED_KV, "K and V hold one merged max(K, V) value"), []
            ).append(layer)
        elif torch.equal(k_read.tensor, v_read.tensor):
            notes.append(f"layer {layer}: K and V scales are identical (merged by the producer?)")
            events.setdefault((Conversion.IDENTICAL_KV, "K and V scales identical"), []).append(
                layer
            )
    ok = not mine
    sources = sorted({r.convention for r in (k_raw, v_raw) if r is not None})
    records = []
    for kind, side, side_read in (("k", k_raw, k_read), ("v", v_raw, v_read)):
        kind_lit: Literal["k", "v"] = "k" if kind == "k" else "v"
        fmt_name = side_read.fmt.name if side_read is not None else None
        if ok:
            kind_steps = steps[kind]
            if side is not None and side.kind == "kv":
                kind_steps = ["one kv_scale for K and V", *kind_steps]
            elif side is not None and side.kind != kind:
                kind_steps = [
                    f"{side.kind.upper()} scale reused (missing_kv='reuse')",
                    *kind_steps,
                ]
            action: Action = "convert" if kind_steps else "use"
            reason = "; ".join(kind_steps) if kind_steps else "used as stored"
            records.append(
                _record(
                    side,
                    layer,
                    kind_lit,
                    action,
                    reason,
                    fmt=fmt_name,
                    granularity=target,
                    scale=finals[kind],
                )
            )
        else:
            # A row carries its own tensor's problems; a healthy sibling says why it is
            # rejected with its layer instead of repeating the other row's reason.
            own = [p for p in mine if side is None or side.name in p]
            other = "V" if kind == "k" else "K"
            other_raw = v_raw if kind == "k" else k_raw
            blamed = other_raw is not None and any(other_raw.name in p for p in mine)
            if side_read is not None and not own and blamed:
                reason = (
                    f"this {kind.upper()} scale is fine on its own; layer {layer} is "
                    f"rejected because of its {other} scale (see the {other} row)"
                )
            else:
                reason = " | ".join(own or mine)
            if side is None:
                reason = f"no {kind.upper()} scale; " + reason
            records.append(
                _record(side, layer, kind_lit, "reject", reason, fmt=fmt_name, granularity=target)
            )
    return LayerScales(
        layer=layer,
        granularity=target,
        k=finals["k"] if ok else None,
        v=finals["v"] if ok else None,
        group_size=None,
        source="+".join(sources) if sources else "none",
        k_record=records[0],
        v_record=records[1],
        notes=tuple(notes),
        problems=tuple(mine),
    )


def _summarise(
    events: Mapping[tuple[Conversion, str], list[int]],
    reductions: list[tuple[int, float]],
    layers: Sequence[LayerScales],
) -> tuple[list[AppliedConversion], list[str]]:
    """The applied conversions and the model-level notes (one line each)."""
    applied = [
        AppliedConversion(conv, f"{what}: layers {format_layers(ls)}", tuple(sorted(set(ls))))
        for (conv, what), ls in events.items()
    ]
    if reductions:
        ratios = [r for _, r in reductions]
        worst_layer, worst = max(reductions, key=lambda item: item[1])
        applied.append(
            AppliedConversion(
                Conversion.PER_HEAD_MAX,
                f"per-head -> per-tensor cost: max/min scale ratio per layer median "
                f"{statistics.median(ratios):.3g}, worst {worst:.3g} (layer {worst_layer}); the "
                f"head with the smallest scale loses up to {math.log2(max(worst, 1.0)):.2f} bits",
                tuple(sorted({layer for layer, _ in reductions})),
            )
        )
    model_notes = [a.note for a in applied]
    used = [t for layer_scales in layers for t in (layer_scales.k, layer_scales.v) if t is not None]
    if used and all(bool((t == 1.0).all()) for t in used):
        model_notes.append(
            "every KV scale is exactly 1.0: the producer probably clamped or defaulted them "
            "(ModelOpt's legacy export clamps to >= 1.0); used as stored, re-calibrate if "
            "accuracy drops"
        )
    return applied, model_notes


def _dynamic(
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
                    _record(
                        found,
                        layer,
                        kind_lit,
                        "ignore",
                        f'checkpoint scale ignored: scale_format="{name}" computes scales '
                        "while writing the cache",
                        fmt=name,
                        granularity="fp32-group",
                    )
                )
            else:
                recs.append(
                    _record(
                        None, layer, kind_lit, "default", why, fmt=name, granularity="fp32-group"
                    )
                )
        layers.append(
            LayerScales(
                layer=layer,
                granularity="fp32-group",
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
        granularity="fp32-group",
        group_size=size,
        layers=tuple(layers),
        notes=tuple(notes),
        problems=tuple(problems),
        options=options,
        conversions=tuple(applied),
    )


def _no_scales(
    geometry: LayerGeometry,
    group_size: int | None,
    options: dict[str, Any],
    missing_scales: str,
    requested: ScaleFormat | None,
    target: Granularity | None,
    problems: list[str],
) -> ModelScales:
    """Apply ``missing_scales`` when no layer has a checkpoint scale."""
    last = geometry.num_layers - 1
    if missing_scales == "dynamic" and requested is None:
        return _dynamic(
            (),
            geometry,
            group_size,
            options,
            "fp32-group",
            explicit=False,
            reason=None,
            problems=problems,
        )
    if missing_scales == "unit":
        granularity: Granularity = target or "per-tensor"
        reason = 'no KV scale in the checkpoint; 1.0 used (missing_scales="unit")'
        layers = []
        for layer in range(geometry.num_layers):
            shape = () if granularity == "per-tensor" else (geometry.kv_heads_of(layer),)
            k = torch.ones(shape, dtype=torch.float32)
            v = torch.ones(shape, dtype=torch.float32)
            layers.append(
                LayerScales(
                    layer=layer,
                    granularity=granularity,
                    k=k,
                    v=v,
                    group_size=None,
                    source="unit",
                    k_record=ScaleRecord(
                        layer,
                        "k",
                        "default",
                        reason,
                        granularity=granularity,
                        scale=tuple(float(x) for x in k.reshape(-1)),
                    ),
                    v_record=ScaleRecord(
                        layer,
                        "v",
                        "default",
                        reason,
                        granularity=granularity,
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
            granularity=granularity,
            group_size=None,
            layers=tuple(layers),
            notes=(note,),
            problems=tuple(problems),
            options=options,
            conversions=(
                AppliedConversion(Conversion.UNIT_DEFAULT, note, tuple(range(geometry.num_layers))),
            ),
        )
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
    granularity_out: Granularity = target or "fp32-group"
    reason = "no KV scale in the checkpoint"
    layers = [
        LayerScales(
            layer=layer,
            granularity=granularity_out,
            k=None,
            v=None,
            group_size=None,
            source="none",
            k_record=_record(None, layer, "k", "reject", reason, granularity=granularity_out),
            v_record=_record(None, layer, "v", "reject", reason, granularity=granularity_out),
            problems=(problem,),  # every layer lacks its scales
        )
        for layer in range(geometry.num_layers)
    ]
    return ModelScales(
        geometry=geometry,
        granularity=granularity_out,
        group_size=None,
        layers=tuple(layers),
        notes=(),
        problems=(*problems, problem),
        options=options,
    )


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

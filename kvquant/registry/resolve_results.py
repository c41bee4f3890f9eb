"""What scale resolution returns: one :class:`ScaleRecord` per cache and layer, :class:`LayerScales`
per layer and :class:`ModelScales` for the model, with their reports and JSON."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvquant.errors import ScaleFormatError
from kvquant.registry.conversions import AppliedConversion, Conversion
from kvquant.registry.fp4 import Fp4Layer
from kvquant.registry.policy import (
    format_layers,
)
from kvquant.registry.registry import (
    BUILTIN_FORMATS,
)
from kvquant.schemes import Scheme
from kvquant.types import (
    KTransform,
    LayerGeometry,
)

__all__ = [
    "BUILTIN_NAMES",
    "Action",
    "LayerScales",
    "ModelScales",
    "ScaleRecord",
    "dtype_name",
    "layers_phrase",
    "summarise",
]


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
BUILTIN_NAMES = frozenset(f.name for f in BUILTIN_FORMATS)


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
        scheme: the layer's scale scheme (:class:`~kvquant.schemes.PerTensorScales`,
            :class:`~kvquant.schemes.PerHeadScales`, :class:`~kvquant.schemes.GroupScales` or
            :class:`~kvquant.schemes.KTransformScales`); its word is :attr:`granularity`.
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
    scheme: type[Scheme]
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
    def granularity(self) -> str:
        """The scheme's word (``"per-tensor"``, ``"per-head"``, ...), for reports and JSON."""
        return self.scheme.name

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
        scheme: the scale scheme every layer uses; its word is :attr:`granularity`.
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
        fp4_layers: the layers a checkpoint stores with a 4-bit side, with their canonical
            NVFP4 global scales (:func:`~kvquant.registry.fp4.resolve_fp4_raws`); their
            entries in :attr:`layers` hold the FP8 reading of the same tensors, which only an
            FP8 side uses.
    """

    geometry: LayerGeometry
    scheme: type[Scheme]
    group_size: int | None
    layers: tuple[LayerScales, ...]
    notes: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    conversions: tuple[AppliedConversion, ...] = ()
    k_transform: KTransform | None = None
    fp4_layers: Mapping[int, Fp4Layer] = field(default_factory=dict)

    @property
    def granularity(self) -> str:
        """The scheme's word (``"per-tensor"``, ``"per-head"``, ...), for reports and JSON."""
        return self.scheme.name

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


def layers_phrase(layers: Sequence[int], verb: str = "have") -> str:
    """``"layer 3 has"`` / ``"layers 4-7, 9 have"`` (``verb`` "do" gives "does" / "do")."""
    single = {"have": "has", "do": "does"}[verb]
    if len(layers) == 1:
        return f"layer {layers[0]} {single}"
    return f"layers {format_layers(layers)} {verb}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def summarise(
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

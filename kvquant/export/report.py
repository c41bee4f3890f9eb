"""What ``kvquant export`` (and ``kvquant calibrate``) wrote: :class:`ExportReport`, one :class:`LayerExport` per layer."""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvquant.tables import WIDTH, render_table

__all__ = ["ExportReport", "LayerExport"]


@dataclass(frozen=True)
class LayerExport:
    """What was written for one decoder layer.

    Attributes:
        layer: decoder layer index.
        k_name: the K scale's tensor name in the output.
        v_name: the V scale's tensor name in the output.
        shape: the stored shape of both tensors.
        k: the fp32 K value(s) written.
        v: the fp32 V value(s) written.
        k_ratio: max/min over the KV heads of the K scale before a per-head ->
            per-tensor reduction (1.0 when nothing was reduced).
        v_ratio: same for V.
        sources: the source tensor names.
    """

    layer: int
    k_name: str
    v_name: str
    shape: tuple[int, ...]
    k: tuple[float, ...]
    v: tuple[float, ...]
    k_ratio: float = 1.0
    v_ratio: float = 1.0
    sources: tuple[str, ...] = ()

    @property
    def reduction_ratio(self) -> float:
        """The larger of the K and V max/min ratios (1.0: lossless)."""
        return max(self.k_ratio, self.v_ratio)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "layer": self.layer,
            "k_name": self.k_name,
            "v_name": self.v_name,
            "shape": list(self.shape),
            "k": list(self.k),
            "v": list(self.v),
            "k_ratio": self.k_ratio,
            "v_ratio": self.v_ratio,
            "sources": list(self.sources),
        }


@dataclass(frozen=True, eq=False)
class ExportReport:
    """The result of :func:`export_checkpoint`.

    Attributes:
        source: the source checkpoint folder.
        out: the output folder.
        engine: ``"vllm"``, ``"sglang"`` or ``"tensorrt-llm"``.
        granularity: ``"per-tensor"`` or ``"per-head"``.
        source_producer: the producer convention discovery decided for the source.
        target_convention: the convention written (``"compressed-tensors"`` or ``"modelopt"``).
        layers: one :class:`LayerExport` per decoder layer.
        notes: what was converted and why (registry notes included).
        warnings: what the user must know before serving the output.
        rewritten_files: output files written anew (shards holding scales, configs, index).
        linked_files: files hard-linked from the source.
        copied_files: files copied from the source.
    """

    source: str
    out: str
    engine: str
    granularity: str
    source_producer: str
    target_convention: str
    layers: tuple[LayerExport, ...]
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    rewritten_files: tuple[str, ...] = ()
    linked_files: tuple[str, ...] = ()
    copied_files: tuple[str, ...] = ()

    @property
    def reduced(self) -> bool:
        """Whether any per-head scale was reduced to per-tensor (lossy)."""
        return any(layer.reduction_ratio > 1.0 for layer in self.layers)

    @property
    def max_reduction_ratio(self) -> float:
        """The worst per-layer max/min ratio of the reduction (1.0: lossless)."""
        return max((layer.reduction_ratio for layer in self.layers), default=1.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the report."""
        return {
            "source": self.source,
            "out": self.out,
            "engine": self.engine,
            "granularity": self.granularity,
            "source_producer": self.source_producer,
            "target_convention": self.target_convention,
            "reduced": self.reduced,
            "max_reduction_ratio": self.max_reduction_ratio,
            "layers": [layer.to_dict() for layer in self.layers],
            "notes": list(self.notes),
            "warnings": list(self.warnings),
            "rewritten_files": list(self.rewritten_files),
            "linked_files": list(self.linked_files),
            "copied_files": list(self.copied_files),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """Return :meth:`to_dict` as strict JSON."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def render(self, width: int = WIDTH) -> str:
        """Plain-text summary: header, one row per layer, notes and warnings, at most ``width`` columns."""
        lines = [
            f"exported:   {self.source} -> {self.out}",
            f"engine:     {self.engine} ({self.granularity})",
            f"convention: {self.source_producer} -> {self.target_convention}",
        ]
        if self.reduced:
            worst = max(self.layers, key=lambda layer: layer.reduction_ratio)
            cost = (
                f"per-head -> per-tensor with max; worst max/min ratio "
                f"{self.max_reduction_ratio:.3g} (layer {worst.layer}, the smallest head "
                f"loses up to {math.log2(self.max_reduction_ratio):.2f} bits)"
            )
            lines.append(
                textwrap.fill(
                    cost, width=width, initial_indent="cost:       ", subsequent_indent=" " * 12
                )
            )
        k_pattern = _name_pattern([(layer.layer, layer.k_name) for layer in self.layers])
        v_pattern = _name_pattern([(layer.layer, layer.v_name) for layer in self.layers])
        named = not (k_pattern and v_pattern)
        if not named:
            lines.append(f"K tensors:  {k_pattern}")
            lines.append(f"V tensors:  {v_pattern}")
        lines.append("")
        header: tuple[str, ...] = ("layer", "K tensor", "V tensor") if named else ("layer",)
        header += ("shape", "K", "V", "max/min")
        rows = []
        for layer in self.layers:
            names = (layer.k_name, layer.v_name) if named else ()
            rows.append(
                (
                    str(layer.layer),
                    *names,
                    str(layer.shape),
                    _fmt_values(layer.k),
                    _fmt_values(layer.v),
                    f"{layer.reduction_ratio:.3g}",
                )
            )
        lines.append(
            render_table(
                header,
                rows,
                wrap={"K tensor", "V tensor", "K", "V"},
                right={"max/min"},
                width=width,
            )
        )
        for title, items in (("notes:", self.notes), ("warnings:", self.warnings)):
            if items:
                lines += ["", title]
                lines.extend(
                    textwrap.fill(
                        item,
                        width=width,
                        initial_indent="  - ",
                        subsequent_indent="    ",
                        break_long_words=False,
                        break_on_hyphens=False,
                    )
                    for item in items
                )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def _name_pattern(names: Sequence[tuple[int, str]]) -> str:
    """``"model.layers.N.self_attn.k_scale"`` when every name is that with its layer as N."""
    patterns = set()
    for layer, name in names:
        marker = f"layers.{layer}."
        if marker not in name:
            return ""
        patterns.add(name.replace(marker, "layers.N.", 1))
    return patterns.pop() if len(patterns) == 1 else ""


def _fmt_values(values: Sequence[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.6g}"
    return "[" + ", ".join(f"{v:.4g}" for v in values) + "]"

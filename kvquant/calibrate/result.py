"""What calibration chose: :class:`CalibrationResult` (scales, per-layer search report, metadata).

Its ``to_dict`` is what ``kvquant calibrate --json`` prints and what the written
checkpoint's ``kvquant-calibration.json`` holds; ``render`` is the command's text.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from kvquant.calibrate.layer_map import LayerFormatMap
from kvquant.calibrate.options import Granularity, Objective, Rotation
from kvquant.calibrate.report import CalibrationReport
from kvquant.calibrate.statistics import KVStatistics
from kvquant.errors import CalibrationError

__all__ = ["CalibrationResult", "LayerCalibration"]


@dataclass(frozen=True)
class LayerCalibration:
    """What the search chose for one decoder layer.

    Attributes:
        layer: decoder layer index.
        k_ratio: chosen clipping ratio of K (one value, or one per KV head).
        v_ratio: same for V.
        k_saturation: estimated fraction of the layer's K values above ``r * amax`` (clipped).
        v_saturation: same for V.
        k_mse_vs_amax: expected K MSE with the chosen scale / with ``amax / 448``.
        v_mse_vs_amax: same for V.
        k_amax: max |K| (one value, or one per KV head).
        v_amax: max |V|.
    """

    layer: int
    k_ratio: tuple[float, ...]
    v_ratio: tuple[float, ...]
    k_saturation: float
    v_saturation: float
    k_mse_vs_amax: float
    v_mse_vs_amax: float
    k_amax: tuple[float, ...]
    v_amax: tuple[float, ...]


@dataclass(frozen=True, eq=False)
class CalibrationResult:
    """Calibrated static scales plus the per-layer report.

    Attributes:
        granularity: ``"per-tensor"``, ``"per-head"`` or ``"k-transform"``.
        k_scales: fp32 [num_layers] (per-tensor) or [num_layers, num_kv_heads]
            (per-head, k-transform) dequantization scales of K (``x ≈ fp8 * s``;
            for the k-transform, of ``k R - c``).
        v_scales: same for V.
        layers: one :class:`LayerCalibration` per layer.
        num_tokens: calibration tokens run through the model.
        num_kv_heads: KV heads per layer.
        ratios: the ratio grid searched.
        tolerance: the relative MSE margin of the choice.
        objective: ``"mse"`` or ``"attention"`` (see :func:`choose_scales`).
        texts: where the calibration data came from (file names, or the dataset,
            config, split and column), when known.
        statistics: the :class:`KVStatistics` the scales were chosen from.
        num_samples: calibration samples (forward passes) run through the model.
        k_offset: fp32 [num_layers, num_kv_heads, head_dim] per-channel K offsets
            in the rotated frame (k-transform only).
        rotation: ``"hadamard"`` or None (k-transform only).
        first_tokens: first positions of every sequence attended at full
            precision (k-transform only; 0 otherwise).
        centre: how the offsets were chosen, ``"mean"`` or ``"midrange"`` (k-transform).
        report: the :class:`~kvquant.calibrate.report.CalibrationReport`
            measured on held-out windows, or None when none was held out.
        layer_map: the per-layer K/V format map proposed for a byte budget
            (``calibrate(..., kv_budget=...)``), or None when none was asked for.
    """

    granularity: str
    k_scales: torch.Tensor
    v_scales: torch.Tensor
    layers: tuple[LayerCalibration, ...]
    num_tokens: int
    num_kv_heads: int
    ratios: tuple[float, ...]
    tolerance: float
    objective: str = "mse"
    texts: tuple[str, ...] = ()
    statistics: KVStatistics | None = None
    num_samples: int = 0
    k_offset: torch.Tensor | None = None
    rotation: str | None = None
    first_tokens: int = 0
    centre: str | None = None
    report: CalibrationReport | None = None
    layer_map: LayerFormatMap | None = None

    @property
    def observer(self) -> str:
        """compressed-tensors' name for how the scales were chosen.

        ``"minmax"`` when only ``r = 1.0`` was searched (``amax / 448``), else
        ``"mse"`` (a clipping search minimising the expected quantization error).
        """
        return "minmax" if self.ratios == (1.0,) else "mse"

    @property
    def method(self) -> str:
        """One line: how the scales were chosen."""
        if self.granularity == Granularity.K_TRANSFORM:
            rot = "Hadamard-rotated K" if self.rotation == Rotation.HADAMARD else "K (no rotation)"
            return (
                f"k-transform: {rot} minus a per-channel offset (the {self.centre} over the "
                f"calibration tokens, the first {self.first_tokens} of each window left out), "
                "K scale = amax of the result / 448 per head; V: "
                + (
                    "scale = amax / 448 per head"
                    if self.ratios == (1.0,)
                    else f"per-head clipping search minimising the {Objective(self.objective).description}"
                )
            )
        if self.observer == "minmax":
            return "scale = amax / 448 (no clipping search)"
        return (
            f"clipping search: scale = r * amax / 448 with r in [{min(self.ratios):.2f}, "
            f"{max(self.ratios):.2f}] ({len(self.ratios)} values) minimising the "
            f"{Objective(self.objective).description}"
        )

    @property
    def num_layers(self) -> int:
        """Decoder layers calibrated."""
        return len(self.layers)

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Canonical scales of one layer.

        Args:
            layer: decoder layer index.

        Returns:
            ``(k, v)``: fp32 [] (per-tensor) or fp32 [num_kv_heads] (per-head).

        Raises:
            CalibrationError: layer out of range.
        """
        if not 0 <= layer < self.num_layers:
            raise CalibrationError(
                f"CalibrationResult.layer_scales: layer {layer}; expected "
                f"0..{self.num_layers - 1}. Fix: ask for a calibrated layer."
            )
        return self.k_scales[layer].clone(), self.v_scales[layer].clone()

    def with_report(self, report: CalibrationReport | None) -> CalibrationResult:
        """A copy carrying ``report``."""
        return replace(self, report=report)

    def with_layer_map(self, layer_map: LayerFormatMap | None) -> CalibrationResult:
        """A copy carrying ``layer_map``."""
        return replace(self, layer_map=layer_map)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (scales as lists, statistics left out)."""
        return {
            "granularity": self.granularity,
            "observer": self.observer,
            "method": self.method,
            "objective": self.objective,
            "objective_description": Objective(self.objective).description,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "num_kv_heads": self.num_kv_heads,
            "ratios": [min(self.ratios), max(self.ratios), len(self.ratios)],
            "tolerance": self.tolerance,
            "texts": list(self.texts),
            "k_scales": self.k_scales.tolist(),
            "v_scales": self.v_scales.tolist(),
            "layers": [asdict(layer) for layer in self.layers],
            **(
                {
                    "rotation": self.rotation,
                    "first_tokens": self.first_tokens,
                    "centre": self.centre,
                }
                if self.granularity == Granularity.K_TRANSFORM
                else {}
            ),
            "report": self.report.to_dict() if self.report is not None else None,
            **({"kv_format_map": self.layer_map.to_dict()} if self.layer_map is not None else {}),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as strict JSON."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def render(self, *, full: bool = False, width: int = 100, cli: bool = False) -> str:
        """Plain-text report: what it calibrated on and how, the scales chosen, the formats compared.

        Args:
            full: one row per layer (clipping ratios, saturation, MSE) and the
                report's per-layer tables; default: their ranges in a few lines.
            width: the widest a line may be.
            cli: point at ``--full`` (the command line's flag) for the per-layer tables.
        """
        import statistics
        import textwrap

        from kvquant.tables import render_table

        def field(label: str, text: str) -> str:
            return textwrap.fill(
                text,
                width=width,
                initial_indent=f"{label:<12}",
                subsequent_indent=" " * 12,
                break_long_words=False,
                break_on_hyphens=False,
            )

        source = "; ".join(self.texts) if self.texts else "token ids"
        lines = [f"calibrated: {self.num_layers} layers, {self.granularity} scales"]
        data = f"{source}: {self.num_samples} samples, {self.num_tokens} tokens"
        if self.report is not None:
            n = self.report.held_out_windows
            data += (
                f" (and {n} sample{'s' if n != 1 else ''}, {self.report.held_out_tokens} "
                "tokens held out for the comparison below)"
            )
        lines += [field("data:", data), field("method:", self.method)]
        for kind in ("k", "v"):
            ratios = [r for lay in self.layers for r in getattr(lay, f"{kind}_ratio")]
            sat = [getattr(lay, f"{kind}_saturation") for lay in self.layers]
            lines.append(
                field(
                    f"{kind.upper()} scales:",
                    (
                        f"r = {min(ratios):.2f}"
                        if min(ratios) == max(ratios)
                        else f"r = {min(ratios):.2f}..{max(ratios):.2f} (median "
                        f"{statistics.median(ratios):.2f})"
                    )
                    + f" times amax / 448; at most {100 * max(sat):.3f}% of a layer's values "
                    "saturate",
                )
            )
        if full:
            lines.append("")
            header: tuple[str, ...] = ("layer", "K ratio", "K sat.", "K MSE/amax", "V ratio")
            header += ("V sat.", "V MSE/amax")
            rows = [
                (
                    str(lay.layer),
                    _fmt_ratios(lay.k_ratio),
                    f"{100 * lay.k_saturation:.3f}%",
                    f"{lay.k_mse_vs_amax:.3f}",
                    _fmt_ratios(lay.v_ratio),
                    f"{100 * lay.v_saturation:.3f}%",
                    f"{lay.v_mse_vs_amax:.3f}",
                )
                for lay in self.layers
            ]
            numbers = set(header[1:])
            lines.append(
                render_table(header, rows, wrap={"K ratio", "V ratio"}, right=numbers, width=width)
            )
            lines.append(
                field(
                    "",
                    "ratio: r of scale = r * amax / 448; sat.: values above r * amax; MSE/amax: "
                    "the expected FP8 error at this scale over the error at amax / 448",
                )
            )
        if self.report is not None:
            lines += ["", self.report.render(full=full, width=width, cli=cli)]
        if self.layer_map is not None:
            lines += ["", self.layer_map.render(width=width)]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def _fmt_ratios(values: tuple[float, ...]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return "/".join(f"{v:.2f}" for v in values)

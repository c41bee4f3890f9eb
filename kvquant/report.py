"""What kvquant would do with a checkpoint: :func:`inspect_checkpoint` and :class:`CheckpointReport`.

:func:`inspect_checkpoint` chains discovery (config, safetensors headers, the
scale tensors only; :func:`~kvquant.registry.discovery.discover_scales`) and the
registry's normalise-or-reject step in analysis mode
(:func:`~kvquant.registry.resolve.analyze_scales`: nothing raises for a bad
layer, every layer gets a K row and a V row). The report renders as an aligned
plain-text table (:meth:`CheckpointReport.render`, what ``kvquant doctor``
prints) and as JSON (:meth:`CheckpointReport.to_json`).

Row actions (the registry's vocabulary): ``use`` (as stored), ``convert``
(cast, reshaped, broadcast, reduced, widened, shared; the reason lists the
steps), ``reject`` (would not load; the reason says why and the fix),
``ignore`` (a stored scale not used because ``fp32-group`` was chosen),
``default`` (no stored scale: dynamic fp32-group or 1.0).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvquant.registry.discovery import DiscoveredCheckpoint, Finding, discover_scales
from kvquant.registry.resolve import ModelScales, ScaleRecord, analyze_scales
from kvquant.registry.types import LayerGeometry

__all__ = ["CheckpointReport", "inspect_checkpoint"]


@dataclass(frozen=True, eq=False)
class CheckpointReport:
    """The doctor's verdict on a checkpoint.

    Attributes:
        path: the checkpoint folder.
        producer: the producer convention decided by discovery
            (``"compressed-tensors"``, ``"modelopt"``, ``"quark"``,
            ``"legacy-kv_scale"``, ``"none"``, ...).
        geometry: the model's attention geometry.
        rows: one :class:`~kvquant.registry.resolve.ScaleRecord` per (layer,
            K/V), ordered by layer then kind: tensor, convention, format, raw
            shape/dtype/min/max, action and reason.
        findings: checkpoint-level notes, warnings and errors from discovery
            (producer, KV scheme, FP8 weights, zero points, ...).
        scales: the registry's analysis (canonical tensors for usable layers,
            model-level notes and problems).
        discovered: discovery's result (config, raw scales, files).
    """

    path: str
    producer: str
    geometry: LayerGeometry
    rows: tuple[ScaleRecord, ...]
    findings: tuple[Finding, ...]
    scales: ModelScales
    discovered: DiscoveredCheckpoint | None = field(default=None, repr=False)

    @property
    def granularity(self) -> str | None:
        """The canonical granularity the model would run with; ``None`` when rejected."""
        return self.scales.granularity if self.ok else None

    @property
    def options(self) -> dict[str, Any]:
        """The resolve options the analysis ran with."""
        return dict(self.scales.options)

    @property
    def notes(self) -> tuple[str, ...]:
        """Model-level notes from the registry (conversions, defaults, their cost)."""
        return tuple(self.scales.notes)

    @property
    def problems(self) -> tuple[str, ...]:
        """Every reason the checkpoint would be rejected (registry problems, error findings)."""
        errors = tuple(f.message for f in self.findings if f.severity == "error")
        return (*self.scales.problems, *errors)

    @property
    def rejected_layers(self) -> tuple[int, ...]:
        """Layers with at least one rejected row, ascending."""
        return tuple(sorted({r.layer for r in self.rows if r.action == "reject"}))

    @property
    def ok(self) -> bool:
        """Whether kvquant would load the checkpoint: no registry problem, no error finding."""
        return not self.problems and not self.rejected_layers

    @property
    def exit_code(self) -> int:
        """``kvquant doctor``'s exit code: 0 when :attr:`ok`, else 1."""
        return 0 if self.ok else 1

    @property
    def summary(self) -> str:
        """One line: the verdict, the granularity, and how many rows take each action."""
        counts: dict[str, int] = {}
        for row in self.rows:
            counts[row.action] = counts.get(row.action, 0) + 1
        actions = ", ".join(f"{n} {a}" for a, n in sorted(counts.items())) or "no rows"
        if self.ok:
            gran: str = self.scales.granularity
            if self.scales.group_size:
                gran += f" (G={self.scales.group_size})"
            warnings = sum(f.severity == "warning" for f in self.findings)
            warned = f"; {warnings} warning{'s' if warnings != 1 else ''}" if warnings else ""
            return f"would load with {gran} KV scales ({actions}){warned}"
        bits = []
        if self.rejected_layers:
            bits.append(f"{len(self.rejected_layers)} layer(s) rejected")
        errors = sorted({f.code for f in self.findings if f.severity == "error"})
        if errors:
            bits.append("checkpoint errors: " + ", ".join(errors))
        if not bits:
            bits.append(f"{len(self.scales.problems)} problem(s)")
        return f"would NOT load: {'; '.join(bits)} ({actions})"

    def to_dict(self) -> dict[str, Any]:
        """Return the report as a JSON-ready dict (non-finite numbers as strings)."""
        g = self.geometry
        return {
            "path": self.path,
            "producer": self.producer,
            "ok": self.ok,
            "exit_code": self.exit_code,
            "granularity": self.granularity,
            "group_size": self.scales.group_size if self.ok else None,
            "geometry": {
                "num_layers": g.num_layers,
                "num_heads": g.num_heads,
                "num_kv_heads": g.num_kv_heads,
                "head_dim": g.head_dim,
            },
            "options": {k: _jsonable(v) for k, v in self.options.items()},
            "rejected_layers": list(self.rejected_layers),
            "rows": [r.to_dict() for r in self.rows],
            "findings": [f.to_dict() for f in self.findings],
            "notes": list(self.notes),
            "problems": list(self.problems),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """Return :meth:`to_dict` as strict JSON (no NaN literals)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def render(self) -> str:
        """Render the report as plain text: a header, an aligned table, findings and notes."""
        g = self.geometry
        lines = [
            f"checkpoint: {self.path}",
            f"producer:   {self.producer}",
            f"geometry:   {g.num_layers} layers, {g.num_heads} query heads, "
            f"{g.num_kv_heads} KV heads, head_dim {g.head_dim}",
            f"verdict:    {'OK' if self.ok else 'REJECTED'}: {self.summary}",
            "",
        ]
        header = (
            "layer",
            "kv",
            "tensor",
            "convention",
            "shape",
            "dtype",
            "min",
            "max",
            "format",
            "action",
            "why",
        )
        table = [header]
        for r in self.rows:
            table.append(
                (
                    str(r.layer),
                    r.kind.upper(),
                    r.tensor or "-",
                    r.convention or "-",
                    _fmt_shape(r.raw_shape),
                    _short_dtype(r.raw_dtype),
                    _fmt_num(r.raw_min),
                    _fmt_num(r.raw_max),
                    r.format or "-",
                    r.action,
                    r.reason,
                )
            )
        if len(table) == 1:
            lines.append("(no layers)")
        else:
            widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
            for row in table:
                cells = [row[i].ljust(widths[i]) for i in range(len(header) - 1)]
                lines.append("  ".join([*cells, row[-1]]).rstrip())
        if self.findings or self.notes:
            lines.append("")
            lines.append("findings:")
            for f in self.findings:
                lines.append(f"  [{f.severity}] {f.code}: {f.message}")
            for note in self.notes:
                lines.append(f"  [note] {note}")
        rejected_rows = {r.reason for r in self.rows if r.action == "reject"}
        extra_problems = [p for p in self.scales.problems if not any(p in x for x in rejected_rows)]
        if extra_problems:
            lines.append("")
            lines.append("problems:")
            lines.extend(f"  - {p}" for p in extra_problems)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def _fmt_shape(shape: Sequence[int] | None) -> str:
    if shape is None:
        return "-"
    return str(tuple(shape))


_SHORT_DTYPES = {
    "bfloat16": "bf16",
    "float32": "fp32",
    "float16": "fp16",
    "float64": "fp64",
    "float8_e4m3fn": "fp8e4m3",
}


def _short_dtype(dtype: str | None) -> str:
    if dtype is None:
        return "-"
    return _SHORT_DTYPES.get(dtype, dtype)


def _fmt_num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}"


def inspect_checkpoint(path: str | Path, **options: Any) -> CheckpointReport:
    """Say what kvquant would do with a checkpoint's KV scales, without loading its weights.

    Runs :func:`~kvquant.registry.discovery.discover_scales` (config,
    safetensors headers, the scale tensors only) and
    :func:`~kvquant.registry.resolve.analyze_scales` (normalise-or-reject in
    analysis mode): a bad layer becomes a ``"reject"`` row, not an exception.

    Args:
        path: a checkpoint folder (config.json + model.safetensors or its
            shards), or a hub id in the local Hugging Face cache.
        **options: resolve options passed to the registry: ``scale_format``
            (``"auto"``, ``"per-tensor"``, ``"per-head"``, ``"fp32-group"``, a
            registered name), ``missing_scales`` (``"dynamic"``, ``"error"``,
            ``"unit"``), ``missing_kv`` (``"error"``, ``"reuse"``),
            ``group_size``, ``rope_policy`` (``"widen"``, ``"keep"``); or
            ``options=`` a :class:`~kvquant.registry.ResolveOptions` holding them.

    Returns:
        The :class:`CheckpointReport`; ``report.ok`` says whether kvquant would load it.

    Raises:
        CheckpointError: the path is not a readable checkpoint.
        ScaleFormatError: an option value is not a policy.
        UnknownFormatError: ``scale_format`` names no registered format.

    Example:
        >>> import tempfile
        >>> from kvquant.testing.checkpoints import write_checkpoint
        >>> with tempfile.TemporaryDirectory() as d:
        ...     report = inspect_checkpoint(write_checkpoint(d, convention="modelopt", weights="none"))
        >>> report.ok, report.granularity, [r.action for r in report.rows]
        (True, 'per-tensor', ['use', 'use', 'use', 'use'])
    """
    found = discover_scales(path)
    scales = analyze_scales(found.scales, found.geometry, **options)
    return CheckpointReport(
        path=str(found.path),
        producer=found.producer,
        geometry=found.geometry,
        rows=scales.records,
        findings=found.findings,
        scales=scales,
        discovered=found,
    )

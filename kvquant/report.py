"""What kvquant would do with a checkpoint: :func:`inspect_checkpoint` and :class:`CheckpointReport`.

:func:`inspect_checkpoint` chains discovery (config, safetensors headers, the
scale tensors only; :func:`~kvquant.checkpoint.discovery.discover_scales`) and the
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
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvquant.checkpoint.discovery import DiscoveredCheckpoint, Finding, discover_scales
from kvquant.checkpoint.files import check_path_argument
from kvquant.choices import KVFormat, describe_layer_formats, layer_kv_formats
from kvquant.errors import ScaleFormatError
from kvquant.registry.fp4 import Fp4Layer, format_mismatch, resolve_fp4_raws
from kvquant.registry.policy import format_layers
from kvquant.registry.resolve import ModelScales, ScaleRecord, analyze_scales
from kvquant.schemes import KTransformScales, StaticScales, fp4_format
from kvquant.tables import WIDTH, render_table
from kvquant.types import LayerGeometry

__all__ = ["SUMMARY_ABOVE", "CheckpointReport", "inspect_checkpoint"]


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
        layer_formats: each layer's K/V format (:class:`~kvquant.choices.KVFormat`) when
            a ``kv_format`` was asked for, else empty.
        format_problems: why a layer cannot store its format (a head_dim its 4-bit block
            does not divide; ``fp8-k-nvfp4-v`` on a layer without static K scales).
    """

    path: str
    producer: str
    geometry: LayerGeometry
    rows: tuple[ScaleRecord, ...]
    findings: tuple[Finding, ...]
    scales: ModelScales
    discovered: DiscoveredCheckpoint | None = field(default=None, repr=False)
    layer_formats: tuple[KVFormat, ...] = ()
    format_problems: tuple[str, ...] = ()
    fp4_layers: Mapping[int, Fp4Layer] = field(default_factory=dict, repr=False)
    fp4_problems: tuple[str, ...] = ()

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
        return (*self.scales.problems, *errors, *self.format_problems, *self.fp4_problems)

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
            if self.checkpoint_formats:
                words = sorted({(r["k"], r["v"]) for r in self.checkpoint_formats})
                gran = "/".join(k if k == v else f"{k}-k-{v}-v" for k, v in words)
                gran += " (the checkpoint's per-layer formats and global scales)"
            warnings = sum(f.severity == "warning" for f in self.findings)
            warned = f"; {warnings} warning{'s' if warnings != 1 else ''}" if warnings else ""
            return f"would load with {gran} KV scales ({actions}){warned}"
        bits = []
        if self.rejected_layers:
            bits.append(f"{len(self.rejected_layers)} layer(s) rejected")
        errors = sorted({f.code for f in self.findings if f.severity == "error"})
        if errors:
            bits.append("checkpoint errors: " + ", ".join(errors))
        if self.fp4_problems:
            bits.append("4-bit global scales unusable")
        if not bits:
            bits.append(f"{len(self.problems)} problem(s)")
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
            "k_transform": self.scales.to_dict()["k_transform"] if self.ok else None,
            "k_offsets": [layer.to_dict()["k_offset"] for layer in self.scales.layers],
            "geometry": {
                "num_layers": g.num_layers,
                "num_heads": g.num_heads,
                "num_kv_heads": g.num_kv_heads,
                "head_dim": g.head_dim,
                **(
                    {}
                    if g.uniform
                    else {
                        "layer_num_kv_heads": [g.kv_heads_of(i) for i in range(g.num_layers)],
                        "layer_head_dims": [g.head_dim_of(i) for i in range(g.num_layers)],
                    }
                ),
            },
            "options": {k: _jsonable(v) for k, v in self.options.items()},
            "kv_formats": [str(f) for f in self.layer_formats] or None,
            "rejected_layers": list(self.rejected_layers),
            "rows": [r.to_dict() for r in self.rows],
            "findings": [f.to_dict() for f in self.findings],
            "notes": list(self.notes),
            "problems": list(self.problems),
            **(
                {"checkpoint_kv_formats": list(self.checkpoint_formats)}
                if self.checkpoint_formats
                else {}
            ),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """Return :meth:`to_dict` as strict JSON (no NaN literals)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def render(self, *, full: bool | None = None, width: int = WIDTH, cli: bool = False) -> str:
        """Render the report as plain text: a header, a table, findings and notes.

        Args:
            full: one table row per layer and K/V (True), or one row per distinct
                decision with the layers it covers (False: the summary view: rows
                that differ only in their numbers are one row, with each number's
                range); default: full up to :data:`SUMMARY_ABOVE` layers, the summary above.
            width: the widest a line may be (long reasons are numbered under the table).
            cli: name options as ``kvquant doctor``'s flags (``--full``,
                ``--rope-policy widen``) instead of Python's (``render(full=True)``,
                ``rope_policy='widen'``).

        Returns:
            The report as text.
        """
        g = self.geometry
        if full is None:
            full = g.num_layers <= SUMMARY_ABOVE
        prefix = _tensor_prefix(self.rows)
        lines = [
            f"checkpoint: {self.path}",
            f"producer:   {self.producer}",
            f"geometry:   {g.num_layers} layers, {g.num_heads} query heads, {g.describe()}",
            f"verdict:    {'OK' if self.ok else 'REJECTED'}: {self.summary}",
        ]
        if self.layer_formats:
            lines.append(f"kv format:  {describe_layer_formats(self.layer_formats)}")
        if prefix:
            lines.append(f"tensors:    {prefix}<tensor> (N: the layer)")
        lines.extend(self._kv_format_lines())
        groups = _group_rows(self.rows, self.producer, prefix, full=full)
        header: tuple[str, ...] = ("layer" if full else "layers", "kv", "tensor", "stored")
        header += ("value", "format", "action", "why")
        formats = {row[5] for row in groups}
        if len(formats) == 1:  # one format for every row: said once, above the table
            lines.append(f"format:     {formats.pop()} (every row)")
            header = header[:5] + header[6:]
            groups = [row[:5] + row[6:] for row in groups]
        reasons = {row[-1] for row in groups}
        if len(groups) > 1 and len(reasons) == 1:  # one reason for every row: said once
            lines.append(_wrapped(f"why:        {reasons.pop()} (every row)", width, indent=""))
            header = header[:-1]
            groups = [row[:-1] for row in groups]
        lines.append("")
        if not groups:
            lines.append("(no layers)")
        else:
            # a reason wider than what the other columns leave is numbered under the table
            used = sum(
                2 + max(len(h), *(len(r[i]) for r in groups)) for i, h in enumerate(header[:-1])
            )
            room = max(width - used, _SHORT_REASON)
            notes: dict[str, int] = {}
            table = []
            for row in groups:
                why = row[-1]
                if header[-1] == "why" and len(why) > room:
                    why = f"see [{notes.setdefault(why, len(notes) + 1)}]"
                table.append((*row[:-1], why))
            lines.append(
                render_table(header, table, wrap={"why", "value", "stored", "tensor"}, width=width)
            )
            for why, n in notes.items():
                lines.append(_wrapped(f"[{n}] {why}", width, indent=""))
            if not full:
                how = "--full" if cli else "render(full=True)"
                lines.append(
                    _wrapped(
                        f"(summary: one row per distinct decision; {how} lists all "
                        f"{len(self.rows)} rows)",
                        width,
                        indent="",
                    )
                )
        if self.findings or self.notes:
            lines.append("")
            lines.append("findings:")
            for f in self.findings:
                lines.append(_wrapped(f"[{f.severity}] {f.code}: {f.message}", width))
            for note in self.notes:
                lines.append(_wrapped(f"[note] {note}", width))
        rejected_rows = {r.reason for r in self.rows if r.action == "reject"}
        extra_problems = [p for p in self.scales.problems if not any(p in x for x in rejected_rows)]
        extra_problems += self.format_problems + self.fp4_problems
        if extra_problems:
            lines.append("")
            lines.append("problems:")
            lines.extend(_wrapped(f"- {p}", width) for p in extra_problems)
        text = "\n".join(lines)
        return _OPTION_SPELLING.sub(_flag, text) if cli else text

    def __str__(self) -> str:
        return self.render()

    @property
    def checkpoint_formats(self) -> tuple[dict[str, Any], ...]:
        """Per layer, the 4-bit KV format a checkpoint declares and its canonical NVFP4 global
        scales (``amax / (6 * 448)``); empty for an FP8 checkpoint."""
        formats = self.discovered.kv_formats if self.discovered is not None else None
        out = []
        for i, (k, v) in enumerate(formats or ()):
            layer = self.fp4_layers.get(i)
            row: dict[str, Any] = {"layer": i, "k": k, "v": v}
            for side, g in (("k", getattr(layer, "k", None)), ("v", getattr(layer, "v", None))):
                if g is not None:
                    row[f"{side}_global_scale"] = [float(x) for x in g.value.reshape(-1)]
            out.append(row)
        return tuple(out)

    def _kv_format_lines(self) -> list[str]:
        lines = []
        for row in self.checkpoint_formats:
            sides = []
            for side in ("k", "v"):
                g = row.get(f"{side}_global_scale")
                fmt = fp4_format(row[side])
                text = "FP8 (scale below)" if fmt is None else fmt.name.upper()
                if g is not None:
                    text += " g=" + "/".join(_fmt_num(x) for x in g)
                sides.append(f"{side.upper()} {text}")
            lines.append(f"4-bit kv:   layer {row['layer']}: {', '.join(sides)}")
        if lines:
            lines.append("            (an NVFP4 side's row below: its stored global scale)")
        return lines


_OPTION_SPELLING = re.compile(
    r"\((scale_format|missing_scales|missing_kv|group_size|rope_policy)=(['\"]?)([\w.-]+)\2\)"
)
"""A resolve option named in parentheses, Python-style: ``(rope_policy='widen')``."""


def _flag(m: re.Match[str]) -> str:
    return f"(--{m.group(1).replace('_', '-')} {m.group(3)})"


SUMMARY_ABOVE = 8
"""Above this many layers :meth:`CheckpointReport.render` shows the summary view by default."""

_LAYER_IN_NAME = re.compile(r"^(.*?layers\.)(\d+)\.(.*)$")


def _tensor_prefix(rows: Sequence[ScaleRecord]) -> str:
    """``"model.layers.N."`` when every stored tensor name starts that way, else ``""``."""
    prefixes = set()
    for r in rows:
        if r.tensor:
            m = _LAYER_IN_NAME.match(r.tensor)
            if m is None or int(m.group(2)) != r.layer:
                return ""
            prefixes.add(m.group(1))
    return f"{prefixes.pop()}N." if len(prefixes) == 1 else ""


def _short_tensor(r: ScaleRecord, producer: str, prefix: str) -> str:
    if not r.tensor:
        return "-"
    name = r.tensor
    if prefix:
        m = _LAYER_IN_NAME.match(name)
        name = m.group(3) if m is not None else name
    if r.convention and r.convention != producer:
        name += f" ({r.convention})"
    return name


def _group_rows(
    rows: Sequence[ScaleRecord], producer: str, prefix: str, *, full: bool
) -> list[tuple[str, ...]]:
    """Table rows: one per record (``full``), or one per distinct decision with its layers."""
    if full:
        return [
            (
                str(r.layer),
                r.kind.upper(),
                _short_tensor(r, producer, prefix),
                _fmt_stored(r),
                _fmt_range(r.raw_min, r.raw_max),
                r.format or "-",
                r.action,
                r.reason,
            )
            for r in rows
        ]
    groups: dict[tuple[str, ...], list[tuple[ScaleRecord, list[str]]]] = {}
    for r in rows:
        reason = re.sub(rf"(\blayers?[ .]){r.layer}(?=\D|$)", r"\1N", r.reason)
        numbers: list[str] = []
        if r.action != "reject":  # a rejected row keeps its exact reason (shapes, values)
            numbers = _NUMBER.findall(reason)
            reason = _NUMBER.sub("\0", reason)
        key = (
            r.kind.upper(),
            _short_tensor(r, producer, prefix),
            _fmt_stored(r),
            r.format or "-",
            r.action,
            reason,
        )
        groups.setdefault(key, []).append((r, numbers))
    out: list[tuple[str, ...]] = []
    for (kind, tensor, stored, fmt, action, template), members in groups.items():
        records = [r for r, _ in members]
        mins = [r.raw_min for r in records if r.raw_min is not None]
        maxs = [r.raw_max for r in records if r.raw_max is not None]
        out.append(
            (
                format_layers(r.layer for r in records),
                kind,
                tensor,
                stored,
                _fmt_range(min(mins) if mins else None, max(maxs) if maxs else None),
                fmt,
                action,
                _fill_numbers(template, [numbers for _, numbers in members]),
            )
        )
    return out


_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e[+-]?\d+)?(?![\w.])")
"""A number standing alone in a reason (not part of a name such as ``float32``)."""


def _fill_numbers(template: str, numbers: Sequence[Sequence[str]]) -> str:
    """A grouped reason: each number of the members' reasons, or its range (``1.2..4.5``)."""
    parts = template.split("\0")
    if len(parts) == 1:
        return template
    out = [parts[0]]
    for i, tail in enumerate(parts[1:]):
        values = [float(n[i]) for n in numbers]
        lo, hi = min(values), max(values)
        out.append(_fmt_num(lo) if lo == hi else f"{_fmt_num(lo)}..{_fmt_num(hi)}")
        out.append(tail)
    return "".join(out)


def _fmt_range(lo: float | None, hi: float | None) -> str:
    """``"0.02"`` for one value, ``"0.01..0.04"`` for a range (NaN compares unequal)."""
    if lo is None or hi is None:
        return _fmt_num(lo if hi is None else hi)
    a, b = _fmt_num(lo), _fmt_num(hi)
    return a if a == b else f"{a}..{b}"


def _fmt_stored(r: ScaleRecord) -> str:
    if r.raw_dtype is None and r.raw_shape is None:
        return "-"
    return f"{_short_dtype(r.raw_dtype)} {_fmt_shape(r.raw_shape)}"


_SHORT_REASON = 16
"""The least room a reason gets in the table; longer ones are numbered under it (``see [n]``)."""


def _wrapped(text: str, width: int, indent: str = "  ") -> str:
    return textwrap.fill(
        text,
        width=width,
        initial_indent=indent,
        subsequent_indent=indent + "    ",
        break_on_hyphens=False,
        break_long_words=False,
    )


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


def inspect_checkpoint(
    path: str | Path, *, kv_format: Any = None, **options: Any
) -> CheckpointReport:
    """Say what kvquant would do with a checkpoint's KV scales, without loading its weights.

    Runs :func:`~kvquant.checkpoint.discovery.discover_scales` (config,
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
        kv_format: the ``kv_format`` option of :func:`kvquant.patch` (a format word or a
            per-layer map): the report then gives each layer's format
            (:attr:`CheckpointReport.layer_formats`) and refuses a layer that cannot store
            its format. None: not asked (FP8 for every layer).

    Returns:
        The :class:`CheckpointReport`; ``report.ok`` says whether kvquant would load it.

    Raises:
        CheckpointError: the path is not a readable checkpoint.
        ScaleFormatError: an option value is not a policy.
        UnknownFormatError: ``scale_format`` names no registered format.
        OptionError: ``kv_format`` is not a format word, or a map that fits the layers.

    Example:
        >>> import tempfile
        >>> from kvquant.testing.checkpoints import write_checkpoint
        >>> with tempfile.TemporaryDirectory() as d:
        ...     report = inspect_checkpoint(write_checkpoint(d, convention="modelopt", weights="none"))
        >>> report.ok, report.granularity, [r.action for r in report.rows]
        (True, 'per-tensor', ['use', 'use', 'use', 'use'])
    """
    check_path_argument(path, "inspect_checkpoint: path")
    found = discover_scales(path)
    scales = analyze_scales(found.scales, found.geometry, k_transform=found.k_transform, **options)
    fp4: dict[int, Fp4Layer] = {}
    fp4_problems: tuple[str, ...] = ()
    if found.kv_formats is not None:
        try:
            fp4 = resolve_fp4_raws(found.producer, found.kv_formats, found.scales, found.geometry)
        except ScaleFormatError as exc:
            fp4_problems = (str(exc),)
    formats: tuple[KVFormat, ...] = ()
    if kv_format is not None:
        formats = layer_kv_formats(kv_format, found.geometry.num_layers, "inspect_checkpoint")
    return CheckpointReport(
        fp4_layers=fp4,
        fp4_problems=fp4_problems,
        path=str(found.path),
        producer=found.producer,
        geometry=found.geometry,
        rows=scales.records,
        findings=found.findings,
        scales=scales,
        discovered=found,
        layer_formats=formats,
        format_problems=_format_problems(formats, found.geometry, scales)
        + _checkpoint_format_problems(formats, fp4),
    )


def _checkpoint_format_problems(
    formats: tuple[KVFormat, ...], declared: Mapping[int, Fp4Layer]
) -> tuple[str, ...]:
    """Why an asked ``kv_format`` cannot serve the checkpoint's 4-bit layers."""
    if not formats or not declared:
        return ()
    mismatch = format_mismatch(formats, declared)
    return () if mismatch is None else (mismatch,)


def _format_problems(
    formats: tuple[KVFormat, ...], geometry: LayerGeometry, scales: ModelScales
) -> tuple[str, ...]:
    """Why layers cannot store their ``kv_format`` (what :func:`kvquant.patch` would refuse)."""
    problems = []
    for i, (fmt, ls) in enumerate(zip(formats, scales.layers, strict=False)):
        block = fmt.block_size
        if block is None:  # FP8
            continue
        if geometry.head_dim_of(i) % block:
            problems.append(
                f"layer {i}: kv_format {str(fmt)!r} stores one scale per block of {block} "
                f"channels, but the layer's head_dim is {geometry.head_dim_of(i)}. Fix: "
                "'nvfp4' (blocks of 16) or 'fp8' for this layer."
            )
        static = issubclass(ls.scheme, (StaticScales, KTransformScales))  # a K transform's too
        if fmt.fp8_keys and (ls.k is None or not static):
            problems.append(
                f"layer {i}: kv_format 'fp8-k-nvfp4-v' stores K in FP8 with a static K scale, "
                f"but the layer's scales resolve to {ls.granularity!r}. Fix: a checkpoint with "
                "FP8 KV scales, --missing-scales unit, or 'nvfp4' for this layer."
            )
    return tuple(problems)

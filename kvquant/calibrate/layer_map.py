"""A per-layer K/V format map for a byte budget, chosen by each layer's measured error.

``kvquant calibrate --kv-budget 0.6`` measures every layer under FP8 (the calibrated
scales) and the 4-bit ``kv_format`` words on held-out windows
(:func:`~kvquant.calibrate.evaluate.evaluate_formats` with ``four_bit=True``), then
:func:`propose_layer_formats` gives each layer the format that keeps the summed error
lowest while the KV cache takes at most the budget's share of the bytes FP8 takes in every
layer. The choice is exact (dynamic programming over the bytes a token takes; no greedy
step that a last move could overshoot), deterministic (ties go to the wider format, then
to fewer bytes), and a larger budget never gives a larger total error. The result,
:class:`LayerFormatMap`, says why each layer got its format and gives the ``kv_format``
map that ``kvquant.patch`` and ``KVQuantConfig`` take.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvquant.calibrate.report import CalibrationReport
from kvquant.choices import KVFormat, parse_choice
from kvquant.errors import CalibrationError

__all__ = [
    "FP8",
    "LAYER_FORMATS",
    "METRIC",
    "LayerFormat",
    "LayerFormatMap",
    "check_budget",
    "format_bytes",
    "layer_errors",
    "lowest_budget",
    "propose_from_report",
    "propose_layer_formats",
]

FP8 = KVFormat.FP8
"""The widest format: FP8 K and V with the calibrated scales."""

LAYER_FORMATS: tuple[KVFormat, ...] = (FP8, KVFormat.FP8_K_NVFP4_V, KVFormat.NVFP4, KVFormat.MXFP4)
"""The ``kv_format`` words a map chooses among, widest first."""

REFERENCE = KVFormat.NVFP4
"""The 4-bit format a layer's standing is told against, where it was measured."""

METRIC = (
    "relative attention-output error ||O_fmt - O|| / ||O|| of the layer on held-out "
    "calibration windows, mean over its KV heads; the map minimises the sum over layers"
)
"""What a layer's error is, in words (the report's metric, per layer)."""


def format_bytes(kv_format: str, num_kv_heads: int, head_dim: int, fp8: str = "per-tensor") -> int:
    """Bytes one token takes in one layer, K and V together, in ``kv_format``.

    ``fp8`` names the FP8 scheme of the ``"fp8"`` layers (the calibrated one: per-tensor,
    per-head or k-transform, one byte per element; its static scales are per layer, not per
    token). From the schemes' own ``slot_bytes``.
    """
    from kvquant.schemes import scheme_class

    fmt = parse_choice(KVFormat, kv_format)
    word = fp8 if fmt is not None and not fmt.four_bit else kv_format
    return scheme_class(word).slot_bytes(num_kv_heads, head_dim)


@dataclass(frozen=True)
class LayerFormat:
    """One layer's proposed format.

    Attributes:
        layer: decoder layer index.
        kv_format: its ``kv_format`` word.
        error: its measured error in that format (:data:`METRIC`).
        bytes_per_token: bytes one token takes in the layer, K and V.
        reason: why it got this format, in words.
    """

    layer: int
    kv_format: str
    error: float
    bytes_per_token: int
    reason: str


@dataclass(frozen=True, eq=False)
class LayerFormatMap:
    """The proposed per-layer K/V formats for a byte budget.

    Attributes:
        budget: the budget, a fraction of the bytes FP8 takes in every layer.
        fp8_bytes: bytes one token takes over all layers with FP8 in every layer.
        layers: one :class:`LayerFormat` per layer.
        errors: per format word, each layer's measured error.
        bytes_per_token: per format word, the bytes one token takes in one layer.
        fp8: the FP8 scheme of the ``"fp8"`` layers (e.g. ``"per-tensor"``).
        notes: formats left out and why.
    """

    budget: float
    fp8_bytes: int
    layers: tuple[LayerFormat, ...]
    errors: Mapping[str, tuple[float, ...]]
    bytes_per_token: Mapping[str, int]
    fp8: str = "per-tensor"
    notes: tuple[str, ...] = ()

    @property
    def used_bytes(self) -> int:
        """Bytes one token takes over all layers under the map."""
        return sum(lay.bytes_per_token for lay in self.layers)

    @property
    def fraction(self) -> float:
        """:attr:`used_bytes` over :attr:`fp8_bytes`."""
        return self.used_bytes / self.fp8_bytes

    @property
    def total_error(self) -> float:
        """The summed error of the map's layers (what the choice minimised)."""
        return sum(lay.error for lay in self.layers)

    @property
    def mean_error(self) -> float:
        """:attr:`total_error` over the layers."""
        return self.total_error / len(self.layers)

    @property
    def fp8_error(self) -> float:
        """The summed error with FP8 in every layer."""
        return sum(self.errors[FP8])

    @property
    def kv_format(self) -> dict[int | str, str]:
        """The map ``kvquant.patch(model, kv_format=...)`` takes: the most common format as
        ``"default"`` (ties: the narrower), every other layer by its index."""
        counts = {f: sum(lay.kv_format == f for lay in self.layers) for f in LAYER_FORMATS}
        default = max(reversed(LAYER_FORMATS), key=lambda f: counts[f])
        out: dict[int | str, str] = {
            lay.layer: lay.kv_format for lay in self.layers if lay.kv_format != default
        }
        out["default"] = default
        return out

    @property
    def kv_format_json(self) -> dict[str, str]:
        """:attr:`kv_format` as JSON holds it (``KVQuantConfig``'s saved form: string keys)."""
        return {str(k): v for k, v in self.kv_format.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "budget": self.budget,
            "budget_unit": "fraction of the KV bytes FP8 takes in every layer",
            "method": "exact minimum of the summed error within the budget (dynamic "
            "programming over bytes per token)",
            "metric": METRIC,
            "fp8_scheme": self.fp8,
            "fp8_bytes_per_token": self.fp8_bytes,
            "bytes_per_token": self.used_bytes,
            "fraction_of_fp8": self.fraction,
            "total_error": self.total_error,
            "mean_error": self.mean_error,
            "fp8_total_error": self.fp8_error,
            "kv_format": self.kv_format_json,
            "layer_bytes_per_token": dict(self.bytes_per_token),
            "layers": [
                {
                    "layer": lay.layer,
                    "kv_format": lay.kv_format,
                    "error": lay.error,
                    "bytes_per_token": lay.bytes_per_token,
                    "reason": lay.reason,
                    "errors": {f: e[lay.layer] for f, e in self.errors.items()},
                }
                for lay in self.layers
            ],
            "notes": list(self.notes),
        }

    def render(self, *, width: int = 100) -> str:
        """The map as text: its bytes and error, one row per layer with why, and the option."""
        import textwrap

        from kvquant.tables import render_table

        def fill(text: str) -> str:
            return textwrap.fill(
                text, width=width, break_long_words=False, break_on_hyphens=False,
                subsequent_indent="  ",
            )  # fmt: skip

        lines = [
            fill(
                f"Per-layer K/V formats for a budget of {self.budget:g} of FP8's KV bytes "
                f"({self.budget * self.fp8_bytes:.0f} of the {self.fp8_bytes} bytes a token takes "
                f"with FP8 in every layer): the map takes {self.used_bytes} bytes a token "
                f"({self.fraction:.3f} of FP8's) for a mean layer error of "
                f"{_pct(self.mean_error)} ({_pct(self.fp8_error / len(self.layers))} with FP8 "
                "everywhere). Error: the layer's relative attention-output error on the "
                "held-out tokens, mean over its KV heads; the map is the exact minimum of the "
                "summed error within the budget."
            ),
            "",
        ]
        rows = [
            (
                str(lay.layer),
                lay.kv_format,
                _pct(lay.error),
                str(lay.bytes_per_token),
                lay.reason,
            )
            for lay in self.layers
        ]
        header = ("layer", "format", "error", "bytes/token", "why")
        lines.append(render_table(header, rows, wrap={"why"}, right={"error", "bytes/token"},
                                  width=width))  # fmt: skip
        lines += [
            "",
            fill(f"kvquant.patch(model, kv_format={_literal(self.kv_format)})"),
            fill(f"KVQuantConfig(kv_format=...) as JSON: {json.dumps(self.kv_format_json)}"),
        ]
        lines += [fill(n) for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def _literal(kv_format: Mapping[int | str, str]) -> str:
    return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in kv_format.items()) + "}"


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def check_budget(budget: object, owner: str = "calibrate") -> float:
    """``budget`` as a float in (0, 1].

    Raises:
        CalibrationError: not a number, not finite, at most 0 or above 1.
    """
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise CalibrationError(
            f"{owner}: kv_budget={budget!r}; expected a number in (0, 1], the share of the KV "
            "bytes FP8 takes in every layer. Fix: pass e.g. 0.6."
        )
    value = float(budget)
    if not math.isfinite(value) or not 0.0 < value <= 1.0:
        more = " (FP8 in every layer is the widest map: 1 holds it)" if value > 1.0 else ""
        raise CalibrationError(
            f"{owner}: kv_budget={budget!r}; expected a number in (0, 1], the share of the KV "
            f"bytes FP8 takes in every layer{more}. Fix: pass e.g. 0.6 (4-bit formats take "
            "about 0.53-0.78 of FP8's bytes)."
        )
    return value


def lowest_budget(head_dim: int, fp8: str = "per-tensor") -> float:
    """The least budget a map can meet for a model of ``head_dim``: the narrowest 4-bit format
    whose blocks divide it, in every layer (1.0: none does)."""
    fp8_bytes = format_bytes(FP8, 1, head_dim, fp8)
    sizes = [
        format_bytes(f, 1, head_dim)
        for f in LAYER_FORMATS
        if f.block_size is not None and head_dim % f.block_size == 0
    ]
    return min([fp8_bytes, *sizes]) / fp8_bytes


def propose_layer_formats(
    errors: Mapping[str, Sequence[float]],
    bytes_per_token: Mapping[str, int],
    budget: float,
    *,
    fp8: str = "per-tensor",
    notes: Sequence[str] = (),
) -> LayerFormatMap:
    """Each layer's format, minimising the summed error within ``budget``.

    Exact: a dynamic program over the bytes a token takes (in units of the formats' common
    divisor) keeps, for every byte count, the least summed error of the layers so far; the
    map is the least error at a byte count within the budget (on ties, fewer bytes). Ties
    between a layer's formats go to the wider one (:data:`LAYER_FORMATS`' order).

    Args:
        errors: per ``kv_format`` word, each layer's measured error; ``"fp8"`` is required.
        bytes_per_token: per word, the bytes one token takes in one layer (:func:`format_bytes`).
        budget: the share in (0, 1] of the bytes FP8 takes in every layer.
        fp8: the FP8 scheme of the ``"fp8"`` layers, for the result.
        notes: formats left out and why, for the result.

    Returns:
        The :class:`LayerFormatMap`.

    Raises:
        CalibrationError: a budget outside (0, 1] or below what the narrowest formats take;
            no ``"fp8"`` errors; an unknown word; errors of different lengths or not finite.

    Example:
        >>> errors = {"fp8": [0.01, 0.01], "nvfp4": [0.20, 0.05]}
        >>> m = propose_layer_formats(errors, {"fp8": 256, "nvfp4": 144}, 0.8)
        >>> m.kv_format, m.used_bytes, m.layers[0].reason
        ({0: 'fp8', 'default': 'nvfp4'}, 400, "kept FP8: NVFP4 would err 20.00%, 1.6x the median layer's, the highest of 2")
    """
    share = check_budget(budget)
    names, table = _error_table(errors, bytes_per_token)
    num_layers = table.shape[0]
    sizes = [int(bytes_per_token[f]) for f in names]
    fp8_bytes = num_layers * sizes[0]
    cap_bytes = share * fp8_bytes
    least = num_layers * min(sizes)
    if least > cap_bytes * (1 + 1e-12):
        narrowest = names[sizes.index(min(sizes))]
        lowest = least / fp8_bytes
        raise CalibrationError(
            f"kv_budget={budget!r} asks for {cap_bytes:.0f} bytes a token, but the narrowest "
            f"format measured here, {narrowest} in every layer, takes {least} "
            f"({lowest:.4f} of FP8's {fp8_bytes}); expected a budget from "
            f"{math.ceil(lowest * 1e4) / 1e4:g} to 1. Fix: pass kv_budget (--kv-budget) "
            f"{math.ceil(lowest * 1e4) / 1e4:g} or more."
        )
    unit = math.gcd(*sizes)
    units = [s // unit for s in sizes]
    cap = math.floor(cap_bytes / unit * (1 + 1e-12))
    chosen = _backtrack(*_least_error(table, units, cap), units)
    per_format = {f: tuple(float(x) for x in table[:, i]) for i, f in enumerate(names)}
    formats = [names[j] for j in chosen]
    layers = tuple(
        LayerFormat(
            layer=i,
            kv_format=formats[i],
            error=per_format[formats[i]][i],
            bytes_per_token=sizes[chosen[i]],
            reason=_reason(i, formats, per_format, dict(zip(names, sizes, strict=True))),
        )
        for i in range(num_layers)
    )
    return LayerFormatMap(
        budget=share,
        fp8_bytes=fp8_bytes,
        layers=layers,
        errors=per_format,
        bytes_per_token=dict(zip(names, sizes, strict=True)),
        fp8=fp8,
        notes=tuple(notes),
    )


def _error_table(
    errors: Mapping[str, Sequence[float]], bytes_per_token: Mapping[str, int]
) -> tuple[list[str], torch.Tensor]:
    """The measured words in :data:`LAYER_FORMATS`' order and their errors ``[layers, words]``.

    Raises:
        CalibrationError: no ``"fp8"`` errors; an unknown word; errors of different lengths
            or not finite; a word without its bytes per token.
    """
    names: list[str] = [f for f in LAYER_FORMATS if f in errors]
    unknown = sorted(set(errors) - set(LAYER_FORMATS))
    if FP8 not in errors or unknown:
        raise CalibrationError(
            f"propose_layer_formats: errors for {sorted(errors)}; expected 'fp8' and any of "
            f"{LAYER_FORMATS[1:]}. Fix: measure with evaluate_formats(..., four_bit=True)."
        )
    lengths = {len(errors[f]) for f in names}
    num_layers = len(errors[FP8])
    rows = [list(errors[f]) for f in names] if len(lengths) == 1 else [[]]
    table = torch.tensor(rows, dtype=torch.float64).T
    if len(lengths) != 1 or num_layers == 0 or not bool(torch.isfinite(table).all()):
        raise CalibrationError(
            f"propose_layer_formats: per-format errors of lengths {sorted(lengths)}; expected "
            "one finite error per layer for every format. Fix: pass the report's errors."
        )
    missing = [f for f in names if not isinstance(bytes_per_token.get(f), int)]
    if missing:
        raise CalibrationError(
            f"propose_layer_formats: no bytes per token for {missing}; expected an int per "
            "measured format. Fix: pass format_bytes(word, num_kv_heads, head_dim) for each."
        )
    return names, table


def _backtrack(best: int, picks: torch.Tensor, units: list[int]) -> list[int]:
    """Each layer's format index on the least-error path ending at ``best`` units."""
    chosen = []
    c = best
    for layer in reversed(range(picks.shape[0])):
        j = int(picks[layer, c])
        chosen.append(j)
        c -= units[j]
    chosen.reverse()
    return chosen


def _least_error(table: torch.Tensor, units: list[int], cap: int) -> tuple[int, torch.Tensor]:
    """The byte count (in units, at most ``cap``) of the least summed error, and per layer and
    byte count the format index that reaches it."""
    num_layers = table.shape[0]
    inf = torch.tensor(math.inf, dtype=torch.float64)
    least = torch.full((cap + 1,), math.inf, dtype=torch.float64)
    least[0] = 0.0
    picks = torch.zeros((num_layers, cap + 1), dtype=torch.int64)
    for layer in range(num_layers):
        new = torch.full_like(least, math.inf)
        pick = torch.zeros(cap + 1, dtype=torch.int64)
        for j, u in enumerate(units):  # widest first: a tie keeps the wider format
            if u > cap:
                continue
            cand = torch.full_like(least, math.inf)
            cand[u:] = least[: cap + 1 - u] + table[layer, j]
            better = cand < new
            new = torch.where(better, cand, new)
            pick = torch.where(better, torch.full_like(pick, j), pick)
        least = torch.where(torch.isfinite(new), new, inf)
        picks[layer] = pick
    return int(torch.argmin(least)), picks  # the first least: the fewest bytes


def _reason(
    layer: int,
    formats: list[str],
    errors: Mapping[str, tuple[float, ...]],
    sizes: Mapping[str, int],
) -> str:
    """Why ``layer`` got ``formats[layer]``, against the other layers' errors."""
    fmt = KVFormat(formats[layer])
    e_fp8 = errors[FP8][layer]
    if all(f == FP8 for f in formats):
        return "FP8: the budget holds FP8 in every layer"
    ref = (
        REFERENCE
        if REFERENCE in errors
        else next(f for f in reversed(LAYER_FORMATS) if f in errors)
    )
    ref_errors = errors.get(ref, errors[FP8])
    median = statistics.median(ref_errors)
    e_ref = ref_errors[layer]
    ratio = f"{e_ref / median:.1f}x" if median > 0 else "n/a"
    rank = sorted(range(len(ref_errors)), key=lambda i: (-ref_errors[i], i)).index(layer) + 1
    where = _where(rank, len(formats))
    standing = f"{_pct(e_ref)}, {ratio} the median layer's, {where}"
    saved = sizes[FP8] - sizes[fmt]
    if not fmt.four_bit:
        return f"kept FP8: {KVFormat(ref).label} would err {standing}"
    if fmt.fp8_keys:
        v_label = fmt.sides[1].label
        text = f"K kept FP8, V in {v_label} (errs {_pct(errors[fmt][layer])}, saves {saved} B)"
        if ref == fmt.sides[1]:
            text += f": {v_label} K too would err {standing}"
        return text
    wider = "".join(
        f"{f.label} {_pct(errors[f][layer])}, "
        for f in LAYER_FORMATS
        if f.four_bit and f.fp8_keys and f in errors
    )
    text = (
        f"{fmt.label}: errs {_pct(errors[fmt][layer])} ({wider}FP8 {_pct(e_fp8)}), saves {saved} B"
    )
    if fmt == ref:
        text += f"; {ratio} the median layer's, {where}"
    elif ref == REFERENCE:
        extra = sizes[ref] - sizes[fmt]
        text += f"; {ref.label} would err {_pct(errors[ref][layer])} for {extra} B more"
    return text


def _where(rank: int, count: int) -> str:
    """``"the highest of 30"``, ``"2nd highest of 30"``, ``"the lowest of 30"``."""
    if rank == 1:
        return f"the highest of {count}"
    if rank == count:
        return f"the lowest of {count}"
    return f"{_ordinal(rank)} highest of {count}"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def layer_errors(report: CalibrationReport) -> dict[str, tuple[float, ...]]:
    """Per ``kv_format`` word, each layer's error (mean over KV heads) in ``report``: ``"fp8"``
    is the written format's, the 4-bit words those measured."""
    out: dict[str, tuple[float, ...]] = {}
    for c, name in enumerate(report.candidates):
        word = FP8 if name == report.chosen else name
        if word in LAYER_FORMATS:
            out[word] = tuple(float(x) for x in report.error[c].mean(dim=1))
    return out


def propose_from_report(
    report: CalibrationReport,
    budget: float,
    *,
    num_kv_heads: int,
    head_dim: int,
    fp8: str,
    notes: Sequence[str] = (),
) -> LayerFormatMap:
    """:func:`propose_layer_formats` on a report measured with the 4-bit formats.

    Args:
        report: from :func:`~kvquant.calibrate.evaluate.evaluate_formats` with ``four_bit=True``.
        budget: the share in (0, 1] of the bytes FP8 takes in every layer.
        num_kv_heads: KV heads per layer.
        head_dim: channels per head.
        fp8: the written FP8 scheme (``"per-tensor"``, ``"per-head"``, ``"k-transform"``).
        notes: remarks for the result (the report's notes on 4-bit formats left out are added).

    Raises:
        CalibrationError: the report measured no 4-bit format, or what
            :func:`propose_layer_formats` refuses.
    """
    errors = layer_errors(report)
    if len(errors) < 2:
        raise CalibrationError(
            f"propose_from_report: the report measured {list(report.candidates)}; expected the "
            "4-bit formats too. Fix: calibrate(..., kv_budget=...) or "
            "evaluate_formats(..., four_bit=True)."
        )
    sizes = {f: format_bytes(f, num_kv_heads, head_dim, fp8) for f in errors}
    left_out = [
        n for n in report.notes if any(n.startswith(f + " left out") for f in LAYER_FORMATS)
    ]
    return propose_layer_formats(errors, sizes, budget, fp8=fp8, notes=(*left_out, *notes))

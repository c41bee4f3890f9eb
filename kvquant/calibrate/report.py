"""The calibration report: what each candidate FP8 KV format costs on this model, and which to use.

:class:`CalibrationReport` holds the measured errors (relative attention-output
error per candidate, layer and KV head on held-out windows), the written
format's clipping and subnormal fractions, the K energy in near-constant
channels, and renders them with a recommendation that says who reads each
format (:data:`READERS`). Measured by :mod:`kvquant.calibrate.evaluate`; the
metrics are defined in docs/dev/calibration.md.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from typing import Any

import torch

from kvquant.calibrate.statistics import NEAR_CONSTANT_RATIO
from kvquant.choices import KVFormat

__all__ = ["FOUR_BIT", "HOW", "READERS", "CalibrationReport", "describe"]

FOUR_BIT = frozenset(f for f in KVFormat if f.four_bit)
"""The 4-bit ``kv_format`` words a report may hold (measured for a per-layer format map, and
left out of the FP8 recommendation: they take fewer bytes, a different trade)."""


@dataclass(frozen=True, eq=False)
class CalibrationReport:
    """What each candidate format costs on this model, and which to use.

    Attributes:
        candidates: format names, in measuring order.
        static: per candidate, whether it is static (scales fixed before serving).
        error: fp64 [C, L, H] relative attention-output error per candidate, layer, KV head.
        k_clip: fp64 [L, H] clipping fraction of K at the written format's scales.
        k_subnormal: fp64 [L, H] subnormal fraction of K.
        v_clip: fp64 [L, H] clipping fraction of V.
        v_subnormal: fp64 [L, H] subnormal fraction of V.
        near_constant: fp64 [L, H] share of K energy in near-constant channels.
        chosen: the format written.
        held_out_tokens: held-out tokens the errors were measured on.
        held_out_windows: held-out windows (forward passes).
        notes: remarks (skipped candidates and why).
    """

    candidates: tuple[str, ...]
    static: tuple[bool, ...]
    error: torch.Tensor
    k_clip: torch.Tensor
    k_subnormal: torch.Tensor
    v_clip: torch.Tensor
    v_subnormal: torch.Tensor
    near_constant: torch.Tensor
    chosen: str
    held_out_tokens: int
    held_out_windows: int = 0
    notes: tuple[str, ...] = ()

    @property
    def scores(self) -> dict[str, float]:
        """Per candidate, its error averaged over layers and heads."""
        return {n: float(self.error[i].mean()) for i, n in enumerate(self.candidates)}

    @property
    def best_static(self) -> str:
        """The static candidate with the lowest score."""
        scores = self.scores
        static = [n for n, s in zip(self.candidates, self.static, strict=True) if s]
        return min(static, key=lambda n: scores[n])

    @property
    def dynamic_g32_beats_best_static(self) -> bool | None:
        """Whether fp32-group G=32 scores lower than :attr:`best_static` (None: not measured)."""
        scores = self.scores
        g32 = scores.get("fp32-group G=32")
        return None if g32 is None else g32 < scores[self.best_static]

    @property
    def recommendation(self) -> str:
        """What was written, its error and who reads it, and the formats that measured better.

        For each group of readers (every engine; vLLM and kvquant; kvquant alone), the
        best candidate that beats the written one is named with its error and how to
        get it, so the advice never points at a format without saying who can load it.
        """
        scores = self.scores
        written = self.chosen
        text = (
            f"Written: {describe(written)} scales, error {_pct(scores[written])}, read by "
            f"{READERS.get(written, 'kvquant')}."
        )
        better = []
        seen_readers = set()
        # the formats more engines read first; within a group of readers, the best one
        for name in sorted(
            self.candidates,
            key=lambda n: (-len(READERS.get(n, "kvquant").split(",")), scores[n]),
        ):
            readers = READERS.get(name, "kvquant")
            if scores[name] >= scores[written] or readers in seen_readers or name == written:
                continue
            if name in FOUR_BIT:
                continue
            seen_readers.add(readers)
            better.append(
                f"{describe(name)} {_pct(scores[name])} ({HOW.get(name, '')}; read by {readers})"
            )
        if better:
            text += " Measured better here: " + "; ".join(better) + "."
        else:
            text += " No other format measured here does better."
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (per-layer lists are ``[layer][head]``)."""

        def table(t: torch.Tensor) -> list[list[float]]:
            return [[float(x) for x in row] for row in t]

        return {
            "metric": "relative attention-output error ||O_fmt - O|| / ||O|| per layer and KV "
            "head on held-out calibration windows; score = mean over layers and heads",
            "held_out_tokens": self.held_out_tokens,
            "held_out_windows": self.held_out_windows,
            "written_format": self.chosen,
            "scores": self.scores,
            "static": dict(zip(self.candidates, self.static, strict=True)),
            "best_static": self.best_static,
            "dynamic_g32_beats_best_static": self.dynamic_g32_beats_best_static,
            "recommendation": self.recommendation,
            "read_by": {n: READERS.get(n, "kvquant") for n in self.candidates},
            "near_constant_rule": f"channel std < {NEAR_CONSTANT_RATIO} * |mean| (post-RoPE K, "
            "first tokens left out); share of sum k**2",
            "layers": [
                {
                    "layer": i,
                    "k_clip": [float(x) for x in self.k_clip[i]],
                    "k_subnormal": [float(x) for x in self.k_subnormal[i]],
                    "v_clip": [float(x) for x in self.v_clip[i]],
                    "v_subnormal": [float(x) for x in self.v_subnormal[i]],
                    "near_constant_energy": [float(x) for x in self.near_constant[i]],
                    "error": {
                        n: [float(x) for x in self.error[c, i]]
                        for c, n in enumerate(self.candidates)
                    },
                }
                for i in range(self.error.shape[1])
            ],
            "error_by_candidate": {n: table(self.error[c]) for c, n in enumerate(self.candidates)},
            "notes": list(self.notes),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as strict JSON."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def render(self, *, full: bool = False, width: int = 100, cli: bool = False) -> str:
        """The formats compared, the written scales' clipping, and the recommendation.

        Args:
            full: also the per-layer tables (errors per format; clipped and subnormal
                fractions and near-constant K energy per KV head).
            width: the widest a line may be.
            cli: point at ``--full`` (the command line's flag) for the per-layer tables.
        """
        from kvquant.tables import render_table

        def fill(text: str, indent: str = "") -> str:
            return _fill(text, width, indent)

        scores = self.scores
        windows = f"{self.held_out_windows} sample{'s' if self.held_out_windows != 1 else ''}"
        lines = [
            fill(
                f"How each format does on {self.held_out_tokens} held-out tokens ({windows} the "
                "scales never saw): relative error of the attention output, mean over layers "
                "and KV heads; lower is better."
            ),
            "",
        ]
        rows = []
        for c, name in enumerate(self.candidates):
            per_layer = self.error[c].mean(dim=1)
            worst = int(per_layer.argmax())
            label = describe(name) + (" (written)" if name == self.chosen else "")
            rows.append(
                (
                    label,
                    _pct(scores[name]),
                    f"{_pct(float(per_layer[worst]))} ({worst})",
                    READERS.get(name, "kvquant"),
                )
            )
        lines.append(
            render_table(
                ("format", "error", "worst (layer)", "read by"),
                rows,
                wrap={"read by"},
                right={"error"},
                width=width,
            )
        )
        lines.append("")
        k_clip, v_clip = float(self.k_clip.max()), float(self.v_clip.max())
        k_sub, v_sub = float(self.k_subnormal.max()), float(self.v_subnormal.max())
        lines.append(
            fill(
                f"At the written scales, at most {_pct(k_clip, 3)} of a KV head's keys and "
                f"{_pct(v_clip, 3)} of its values saturate, and at most {_pct(k_sub, 3)} and "
                f"{_pct(v_sub, 3)} are subnormal (fewer significant bits). A median "
                f"{_pct(float(self.near_constant.median()), 0)} of the keys' energy sits in "
                "channels that barely change from token to token, which the k-transform's "
                "offset removes."
            )
        )
        if full:
            lines += self._per_layer(width)
        else:
            how = "--full" if cli else "render(full=True)"
            lines.append(fill(f"(per layer: {how})"))
        lines += ["", fill(self.recommendation), *(fill(t) for t in self.notes)]
        return "\n".join(lines)

    def _per_layer(self, width: int) -> list[str]:
        """The per-layer tables of :meth:`render` with ``full=True``."""
        from kvquant.tables import render_table

        lines = ["", _fill("Per layer: relative attention-output error, in %", width), ""]
        labels = [_column(n) for n in self.candidates]
        errors: list[list[str]] = [
            [
                str(i),
                *(f"{100 * float(self.error[c, i].mean()):.2f}" for c in range(len(labels))),
            ]
            for i in range(self.error.shape[1])
        ]
        lines.append(render_table(("layer", *labels), errors, right=set(labels), width=width))
        legend = [f"{_column(n)}: {describe(n)}" for n in self.candidates if _column(n) != n]
        lines += [_fill(", ".join(legend), width)] if legend else []
        lines += [
            "",
            _fill(
                "Per layer and KV head (a/b/...), in %: keys and values saturated or "
                "subnormal at the written scales; share of the keys' energy in "
                "near-constant channels",
                width,
            ),
            "",
        ]
        header: tuple[str, ...] = ("layer", "K saturated", "K subnormal", "V saturated")
        header += ("V subnormal", "K near-constant")
        heads = _heads
        stats = [
            (
                str(i),
                heads(self.k_clip, i, 3),
                heads(self.k_subnormal, i, 3),
                heads(self.v_clip, i, 3),
                heads(self.v_subnormal, i, 3),
                heads(self.near_constant, i, 0),
            )
            for i in range(self.error.shape[1])
        ]
        lines.append(
            render_table(header, stats, wrap=set(header[1:]), right=set(header[1:]), width=width)
        )
        return lines

    def __str__(self) -> str:
        return self.render()


READERS: dict[str, str] = {
    "per-tensor": "kvquant, vLLM, SGLang",
    "per-head": "kvquant, vLLM",
    "fp32-group G=64": "kvquant",
    "fp32-group G=32": "kvquant",
    "k-transform (hadamard, first tokens)": "kvquant",
    "k-transform (offset only, first tokens)": "kvquant",
    "k-transform (hadamard, no first tokens)": "kvquant",
    "nvfp4": "kvquant",
    "mxfp4": "kvquant",
    "fp8-k-nvfp4-v": "kvquant",
}
"""Who loads each candidate format (``kvquant export`` writes per-tensor and per-head for the engines)."""

HOW: dict[str, str] = {
    "per-tensor": "--format per-tensor",
    "per-head": "--format per-head",
    "fp32-group G=64": "no scales: kvquant computes them while serving",
    "fp32-group G=32": "no scales: kvquant computes them while serving, group size 32",
    "k-transform (hadamard, first tokens)": "--format k-transform",
    "k-transform (offset only, first tokens)": "--format k-transform --rotation none",
    "k-transform (hadamard, no first tokens)": "--format k-transform --first-tokens 0",
    "nvfp4": "kvquant.patch(model, kv_format='nvfp4')",
    "mxfp4": "kvquant.patch(model, kv_format='mxfp4')",
    "fp8-k-nvfp4-v": "kvquant.patch(model, kv_format='fp8-k-nvfp4-v')",
}
"""How to get each candidate format."""

_DESCRIPTIONS = {
    "per-tensor": "per-tensor",
    "per-head": "per-head",
    "fp32-group G=64": "dynamic, 64-channel groups",
    "fp32-group G=32": "dynamic, 32-channel groups",
    "k-transform (hadamard, first tokens)": "k-transform",
    "k-transform (offset only, first tokens)": "k-transform, no rotation",
    "k-transform (hadamard, no first tokens)": "k-transform, no exact first token",
    "nvfp4": "NVFP4 (4-bit K and V)",
    "mxfp4": "MXFP4 (4-bit K and V)",
    "fp8-k-nvfp4-v": "FP8 K, NVFP4 V",
}

_COLUMNS = {
    "fp32-group G=64": "dyn-64",
    "fp32-group G=32": "dyn-32",
    "k-transform (hadamard, first tokens)": "kt",
    "k-transform (offset only, first tokens)": "kt-norot",
    "k-transform (hadamard, no first tokens)": "kt-nofirst",
    "fp8-k-nvfp4-v": "fp8k-nv4v",
}


def describe(name: str) -> str:
    """A candidate format's name in words (``"dynamic, 32-channel groups"``)."""
    return _DESCRIPTIONS.get(name, name)


def _column(name: str) -> str:
    return _COLUMNS.get(name, name)


def _pct(x: float, digits: int = 2) -> str:
    return f"{100 * x:.{digits}f}%"


def _heads(t: torch.Tensor, i: int, digits: int) -> str:
    return "/".join(f"{100 * float(x):.{digits}f}" for x in t[i])


def _fill(text: str, width: int, indent: str = "") -> str:
    return textwrap.fill(
        text,
        width=width,
        break_long_words=False,
        break_on_hyphens=False,
        initial_indent=indent,
        subsequent_indent=indent + "  ",
    )

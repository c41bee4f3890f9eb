"""The calibration report: how each candidate FP8 KV format does on this model, measured.

``kvquant calibrate`` holds out the last calibration windows (``held_out_tokens``)
and, after the scales are chosen, runs the model over them once more. In every
attention layer the post-RoPE query, keys and values are taken as the model made
them, and each candidate format is simulated in torch (e4m3 rounding, the
formulas below); its **relative attention-output error** for one layer and KV
head is ``||O_fmt - O|| / ||O||`` over the held-out positions and the query heads
sharing that KV head, where ``O`` is plain causal softmax attention
(``softmax(scaling * q k^T) v``, fp32) on the exact K/V and ``O_fmt`` the same on
the simulated ones. A format's **score** is that error averaged over layers and
heads. The report's recommendation is the static format with the lowest score,
and whether the dynamic fp32-group G=32 format scores lower still.

Candidates (:func:`candidate_formats`):

* ``per-tensor`` / ``per-head``: ``fp8(clamp(x / s)) * s`` with the static
  scales the search chose for that granularity;
* ``fp32-group G=64`` / ``G=32``: dynamic, ``s = amax / 448`` per token, head
  and group of G channels (only where G divides head_dim);
* ``k-transform`` variants: keys in the rotated frame ``k' = fp8(clamp((k R -
  c) / s_k)) * s_k + c`` against the rotated query ``q R``, values per-head, the
  first ``n`` positions of every window exact (``k R`` and ``v``);
  ``R`` is the Hadamard matrix or the identity (offset only), ``n`` the
  calibrated ``first_tokens`` or 0 (then offsets and scales come from every
  token, the first ones included).

Per layer and head the report also gives, at the scales of the format that was
written, the **clipping fraction** (``|x / s| > 448``: values saturated) and the
**subnormal fraction** (``0 < |x / s| < 2**-6``: below e4m3's smallest normal, so
with fewer significant bits) of K (for the k-transform: of ``k R - c`` at the
positions read from FP8) and of V, on the held-out positions; and the **share
of K energy in near-constant channels**: per channel of the post-RoPE K (model
frame, first tokens left out), mean ``m`` and standard deviation ``sd`` over the
calibration tokens; a channel is near-constant when ``sd < |m| / 4``; the share is
the sum of those channels' ``sum_t k**2`` over the sum of every channel's.

Imports torch, :mod:`kvquant.kernels` (the Hadamard matrix) and :mod:`kvquant.tables`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvquant.errors import CalibrationError

__all__ = [
    "E4M3_MIN_NORMAL",
    "NEAR_CONSTANT_RATIO",
    "CalibrationReport",
    "Candidate",
    "FormatEvaluator",
    "fake_quantize_groups",
    "fake_quantize_static",
    "hadamard_matrix",
    "k_transform_keys",
    "near_constant_share",
]

FP8_E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
"""Smallest normal float8_e4m3fn magnitude: below it values are subnormal."""

NEAR_CONSTANT_RATIO = 0.25
"""A K channel is near-constant when its token-to-token std is below this times ``|mean|``."""

GROUP_SIZES = (64, 32)


def hadamard_matrix(dim: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """:func:`kvquant.kernels.hadamard` (fp32 ``[dim, dim]``), refused with calibration's fix.

    Raises:
        CalibrationError: ``dim`` is not a power of two.
    """
    from kvquant.kernels import hadamard

    if dim < 1 or dim & (dim - 1):
        raise CalibrationError(
            f"Hadamard rotation: head_dim {dim} is not a power of two; the built-in rotation "
            "needs one. Fix: calibrate with rotation=None (--rotation none: offset only)."
        )
    return hadamard(dim, device=device)


def _per_head(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    s = scale.float().to(x.device)
    return s.view(1, -1, 1, 1) if s.dim() == 1 else s


def fake_quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8_e4m3(clamp(x / s, +-448)) * s`` in fp32 (the static write's rounding).

    Args:
        x: [B, Hkv, T, D].
        scale: fp32 [] or [Hkv].
    """
    s = _per_head(scale, x)
    q = (x.float() / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.float() * s


def fake_quantize_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dynamic fp32-group rounding: ``s = amax / 448`` per token, head and group of G channels.

    Args:
        x: [B, Hkv, T, D], D a multiple of ``group_size``.
    """
    d = x.shape[-1]
    xg = x.float().unflatten(-1, (d // group_size, group_size))
    amax = xg.abs().amax(dim=-1, keepdim=True)
    s = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (xg / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() * s
    return q.flatten(-2)


def k_transform_keys(
    key: torch.Tensor,
    k_scale: torch.Tensor,
    k_offset: torch.Tensor,
    rotation: torch.Tensor | None,
    first_tokens: int,
) -> torch.Tensor:
    """Keys as the k-transform's attention reads them, in the rotated frame.

    ``k' = fp8(clamp((k R - c) / s_k, +-448)) * s_k + c``; the first
    ``first_tokens`` positions (of dim 2) are ``k R`` exactly (the side buffer).

    Args:
        key: [B, Hkv, T, D] post-RoPE keys, position ``t`` at index ``t``.
        k_scale: fp32 [Hkv] (or []).
        k_offset: fp32 [Hkv, D], in the rotated frame.
        rotation: fp32 [D, D] orthonormal, or None (identity).
        first_tokens: positions kept exact.

    Returns:
        fp32 [B, Hkv, T, D]; pair it with the query ``q @ R``.
    """
    kr = key.float()
    if rotation is not None:
        kr = kr @ rotation.to(kr.device)
    c = k_offset.float().to(kr.device)[None, :, None, :]
    s = _per_head(k_scale, kr)
    q = ((kr - c) / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    out = q.float() * s + c
    n = min(first_tokens, out.shape[2])
    if n:
        out[:, :, :n] = kr[:, :, :n]
    return out


def near_constant_share(
    count: torch.Tensor, total: torch.Tensor, total_sq: torch.Tensor
) -> torch.Tensor:
    """Share of K energy in near-constant channels (see the module docstring).

    Args:
        count: tokens per layer, [L] (or broadcastable to ``total``'s leading dims).
        total: fp64 [L, H, D], per-channel sum of K over those tokens.
        total_sq: fp64 [L, H, D], per-channel sum of K**2.

    Returns:
        fp64 [L, H] in [0, 1] (0 where no token was seen).
    """
    n = count.double().clamp_min(1.0).view(-1, 1, 1)
    mean = total / n
    var = (total_sq / n - mean.square()).clamp_min(0.0)
    near = var.sqrt() < NEAR_CONSTANT_RATIO * mean.abs()
    energy = total_sq.sum(dim=-1)
    share = (total_sq * near).sum(dim=-1) / energy.clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where(energy > 0, share, torch.zeros_like(share))


@dataclass(frozen=True, eq=False)
class Candidate:
    """One format the report measures.

    Attributes:
        name: label, e.g. ``"per-head"``, ``"fp32-group G=32"``, ``"k-transform"``.
        static: scales (and offsets) fixed before serving.
        k_scale: fp32 [L] or [L, Hkv] static K scales (None for fp32-group).
        v_scale: same for V.
        group_size: G of the dynamic fp32-group format.
        k_offset: fp32 [L, Hkv, D] (rotated frame) for the k-transform.
        rotation: fp32 [D, D] or None.
        first_tokens: positions of every window attended exactly (k-transform).
    """

    name: str
    static: bool
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    group_size: int | None = None
    k_offset: torch.Tensor | None = None
    rotation: torch.Tensor | None = None
    first_tokens: int = 0

    def simulate(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(query, key, value)`` as this format's attention sees them (fp32)."""
        if self.group_size is not None:
            g = self.group_size
            return query.float(), fake_quantize_groups(key, g), fake_quantize_groups(value, g)
        if self.k_scale is None or self.v_scale is None:
            raise CalibrationError(
                f"Candidate {self.name!r}: a static format without scales; expected k_scale "
                "and v_scale. Fix: build it with candidate_formats()."
            )
        v = fake_quantize_static(value, self.v_scale[layer])
        if self.k_offset is None:
            return query.float(), fake_quantize_static(key, self.k_scale[layer]), v
        q = query.float()
        if self.rotation is not None:
            q = q @ self.rotation.to(q.device)
        k = k_transform_keys(
            key, self.k_scale[layer], self.k_offset[layer], self.rotation, self.first_tokens
        )
        n = min(self.first_tokens, v.shape[2])
        if n:
            v[:, :, :n] = value[:, :, :n].float()
        return q, k, v

    def stored(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[Any, Any]:
        """``(k / s_k, v / s_v)`` before rounding, at the positions read from FP8 (static only)."""
        if self.k_scale is None or self.v_scale is None:
            raise CalibrationError(f"Candidate {self.name!r}: dynamic formats store no scale.")
        k = key.float()
        if self.k_offset is not None:
            if self.rotation is not None:
                k = k @ self.rotation.to(k.device)
            k = k - self.k_offset[layer].float().to(k.device)[None, :, None, :]
        n = min(self.first_tokens, k.shape[2])
        k = k[:, :, n:] / _per_head(self.k_scale[layer], k)
        v = value.float()[:, :, n:] / _per_head(self.v_scale[layer], value)
        return k, v


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)


@dataclass
class FormatEvaluator:
    """Accumulates every candidate's attention-output error on held-out windows.

    Attributes:
        candidates: the formats measured.
        chosen: index into ``candidates`` of the format written (clipping and
            subnormal fractions are counted for it), or None.
        num_layers: decoder layers.
        num_kv_heads: KV heads per layer.
    """

    candidates: tuple[Candidate, ...]
    chosen: int | None
    num_layers: int
    num_kv_heads: int
    err2: torch.Tensor = field(init=False)
    ref2: torch.Tensor = field(init=False)
    counts: torch.Tensor = field(init=False)
    seen: torch.Tensor = field(init=False)
    num_tokens: int = 0

    def __post_init__(self) -> None:
        shape = (self.num_layers, self.num_kv_heads)
        self.err2 = torch.zeros((len(self.candidates), *shape), dtype=torch.float64)
        self.ref2 = torch.zeros(shape, dtype=torch.float64)
        # K clipped, K subnormal, V clipped, V subnormal, K values, V values
        self.counts = torch.zeros((6, *shape), dtype=torch.float64)
        self.seen = torch.zeros(self.num_layers, dtype=torch.int64)

    @torch.no_grad()
    def observe(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> None:
        """Add one held-out window of one layer (HF layout, positions from 0, causal)."""
        b, hq, t, d = query.shape
        h = self.num_kv_heads
        ref = _causal_attention(query.float(), key.float(), value.float(), scaling)
        ref = ref.view(b, h, hq // h, t, d)
        self.ref2[layer] += ref.double().square().sum(dim=(0, 2, 3, 4)).cpu()
        for i, cand in enumerate(self.candidates):
            q, k, v = cand.simulate(layer, query, key, value)
            out = _causal_attention(q, k, v, scaling).view(b, h, hq // h, t, d)
            self.err2[i, layer] += (out - ref).double().square().sum(dim=(0, 2, 3, 4)).cpu()
        if self.chosen is not None:
            ks, vs = self.candidates[self.chosen].stored(layer, key, value)
            for j, x in ((0, ks), (2, vs)):
                a = x.abs().transpose(0, 1).reshape(h, -1)
                self.counts[j, layer] += (a > FP8_E4M3_MAX).sum(dim=1).double().cpu()
                sub = (a > 0) & (a < E4M3_MIN_NORMAL)
                self.counts[j + 1, layer] += sub.sum(dim=1).double().cpu()
                self.counts[4 + j // 2, layer] += a.shape[1]
        self.seen[layer] += 1

    def report(
        self,
        near_constant: torch.Tensor,
        chosen_name: str,
        notes: Sequence[str] = (),
        held_out_windows: int = 0,
    ) -> CalibrationReport:
        """The :class:`CalibrationReport` of what was observed.

        Raises:
            CalibrationError: some layer never ran on the held-out windows.
        """
        missing = [i for i in range(self.num_layers) if int(self.seen[i]) == 0]
        if missing:
            raise CalibrationError(
                f"calibration report: layers {missing[:8]} never ran on the held-out windows; "
                "expected every attention layer to. Fix: use a model whose attention calls "
                "transformers' AttentionInterface."
            )
        tiny = torch.finfo(torch.float64).tiny
        error = (self.err2 / self.ref2.clamp_min(tiny)).sqrt()
        kn, vn = self.counts[4].clamp_min(1.0), self.counts[5].clamp_min(1.0)
        return CalibrationReport(
            candidates=tuple(c.name for c in self.candidates),
            static=tuple(c.static for c in self.candidates),
            error=error,
            k_clip=self.counts[0] / kn,
            k_subnormal=self.counts[1] / kn,
            v_clip=self.counts[2] / vn,
            v_subnormal=self.counts[3] / vn,
            near_constant=near_constant.double(),
            chosen=chosen_name,
            held_out_tokens=self.num_tokens,
            held_out_windows=held_out_windows,
            notes=tuple(notes),
        )


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
        import textwrap

        from kvquant.tables import render_table

        def fill(text: str, indent: str = "") -> str:
            return textwrap.fill(
                text,
                width=width,
                break_long_words=False,
                break_on_hyphens=False,
                initial_indent=indent,
                subsequent_indent=indent + "  ",
            )

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
            lines += ["", fill("Per layer: relative attention-output error, in %"), ""]
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
            lines += [fill(", ".join(legend))] if legend else []
            lines += [
                "",
                fill(
                    "Per layer and KV head (a/b/...), in %: keys and values saturated or "
                    "subnormal at the written scales; share of the keys' energy in "
                    "near-constant channels"
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
                render_table(
                    header, stats, wrap=set(header[1:]), right=set(header[1:]), width=width
                )
            )
        else:
            how = "--full" if cli else "render(full=True)"
            lines.append(fill(f"(per layer: {how})"))
        lines += ["", fill(self.recommendation), *(fill(t) for t in self.notes)]
        return "\n".join(lines)

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
}

_COLUMNS = {
    "fp32-group G=64": "dyn-64",
    "fp32-group G=32": "dyn-32",
    "k-transform (hadamard, first tokens)": "kt",
    "k-transform (offset only, first tokens)": "kt-norot",
    "k-transform (hadamard, no first tokens)": "kt-nofirst",
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

"""Every candidate format measured on held-out windows: the numbers of the calibration report.

The model runs once more over windows the statistics never saw; in every
attention layer each :class:`Candidate` (the static formats with the scales the
search chose, the dynamic fp32 groups, the k-transform variants and, on request, the
4-bit formats of ``kvquant.patch(model, kv_format=...)``) is simulated
in torch (:mod:`kvquant.calibrate.fp8`) and its attention output compared with
the exact one (:class:`FormatEvaluator`), giving a
:class:`~kvquant.calibrate.report.CalibrationReport`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvquant.calibrate.collection import observing
from kvquant.calibrate.fp8 import (
    E4M3_MIN_NORMAL,
    FP8_E4M3_MAX,
    fake_quantize_fp4,
    fake_quantize_groups,
    fake_quantize_static,
    hadamard_matrix,
    k_transform_keys,
    k_transform_keys_fp4,
    per_head_scale,
)
from kvquant.calibrate.k_transform import choose_k_transform, k_transform_name
from kvquant.calibrate.options import STATIC_GRANULARITIES, Granularity, Rotation
from kvquant.calibrate.report import CalibrationReport
from kvquant.calibrate.result import CalibrationResult
from kvquant.calibrate.search import DEFAULT_RATIOS, choose_scales
from kvquant.calibrate.statistics import KVStatistics
from kvquant.choices import KVFormat, parse_choice
from kvquant.errors import CalibrationError

__all__ = [
    "GROUP_SIZES",
    "Candidate",
    "FormatEvaluator",
    "candidate_formats",
    "candidate_of",
    "evaluate_formats",
    "four_bit_candidates",
]

FOUR_BIT_FORMATS: tuple[KVFormat, ...] = tuple(f for f in KVFormat if f.four_bit)
"""The 4-bit ``kv_format`` words measured on request (each says its block, which head_dim must
be a multiple of)."""

GROUP_SIZES = (64, 32)
"""Group sizes of the dynamic fp32-group candidates (where they divide head_dim)."""


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
        kv_format: a 4-bit ``kv_format`` word (``"nvfp4"``, ``"mxfp4"``,
            ``"fp8-k-nvfp4-v"``, whose FP8 K reads ``k_scale``), or None (an FP8 format); with
            ``k_offset`` K is in the k-transform's frame.
    """

    name: str
    static: bool
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    group_size: int | None = None
    k_offset: torch.Tensor | None = None
    rotation: torch.Tensor | None = None
    first_tokens: int = 0
    kv_format: str | None = None

    def simulate(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(query, key, value)`` as this format's attention sees them (fp32)."""
        if self.kv_format is not None:
            return self._simulate_fp4(layer, query, key, value)
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
        return self._k_transform_read(self.k_scale, self.k_offset, layer, query, key, value, v)

    def _k_transform_read(
        self,
        k_scale: torch.Tensor | None,
        k_offset: torch.Tensor,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        v: torch.Tensor,
        k_side: str = "",
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The query rotated, K in the k-transform's frame (FP8 with ``k_scale``; without it
        the 4-bit format ``k_side``), ``v`` (V as read) with the first tokens' values exact:
        what attention sees beside a K transform."""
        q = query.float()
        if self.rotation is not None:
            q = q @ self.rotation.to(q.device)
        nf = self.first_tokens
        if k_scale is None:
            k = k_transform_keys_fp4(key, k_side, k_offset[layer], self.rotation, nf)
        else:
            k = k_transform_keys(key, k_scale[layer], k_offset[layer], self.rotation, nf)
        n = min(self.first_tokens, v.shape[2])
        if n:
            v[:, :, :n] = value[:, :, :n].float()
        return q, k, v

    def _simulate_fp4(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A 4-bit format: every position rounded, the first included (as the cache does)."""
        fmt = parse_choice(KVFormat, self.kv_format)
        if fmt is None:  # not a format: fake_quantize_fp4 refuses it
            k_side = v_side = str(self.kv_format)
        else:
            k_side, v_side = fmt.sides
        if fmt is not None and fmt.four_bit and fmt.fp8_keys:
            if self.k_scale is None:
                raise CalibrationError(
                    f"Candidate {self.name!r}: FP8 K without a static K scale; expected "
                    "k_scale. Fix: build it with four_bit_candidates()."
                )
            v = fake_quantize_fp4(value, v_side)
            if self.k_offset is None:
                return query.float(), fake_quantize_static(key, self.k_scale[layer]), v
            return self._k_transform_read(self.k_scale, self.k_offset, layer, query, key, value, v)
        v = fake_quantize_fp4(value, v_side)
        if self.k_offset is not None:  # 4-bit K in the k-transform's frame
            return self._k_transform_read(None, self.k_offset, layer, query, key, value, v, k_side)
        return query.float(), fake_quantize_fp4(key, k_side), v

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
        k = k[:, :, n:] / per_head_scale(self.k_scale[layer], k)
        v = value.float()[:, :, n:] / per_head_scale(self.v_scale[layer], value)
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


def candidate_of(result: CalibrationResult, name: str | None = None) -> Candidate:
    """The report's simulation of a static result."""
    if result.granularity != Granularity.K_TRANSFORM:
        return Candidate(
            name or str(result.granularity), True, k_scale=result.k_scales, v_scale=result.v_scales
        )
    rot = None
    if result.rotation == Rotation.HADAMARD and result.k_offset is not None:
        rot = hadamard_matrix(int(result.k_offset.shape[-1]))
    return Candidate(
        name or k_transform_name(result.rotation, result.first_tokens),
        True,
        k_scale=result.k_scales,
        v_scale=result.v_scales,
        k_offset=result.k_offset,
        rotation=rot,
        first_tokens=result.first_tokens,
    )


def candidate_formats(
    stats: KVStatistics,
    *,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    tolerance: float = 0.0,
    objective: str = "mse",
    centre: str = "mean",
) -> tuple[list[Candidate], list[str]]:
    """The formats the calibration report measures, with their scales from ``stats``.

    per-tensor and per-head (the search of :func:`choose_scales`), fp32-group
    G=64 and G=32 (dynamic; where G divides head_dim), and the k-transform with
    Hadamard rotation and first tokens apart, offset only with first tokens
    apart, and Hadamard rotation with no first tokens (:func:`choose_k_transform`).

    Returns:
        ``(candidates, notes)``: notes say which candidates were left out and why.

    Raises:
        CalibrationError: statistics without channel statistics, or bad options.
    """
    ch = stats.channels
    if ch is None:
        raise CalibrationError(
            "candidate_formats: these statistics have no per-channel K statistics. "
            "Fix: collect with collect_statistics (it keeps them)."
        )
    opts: dict[str, Any] = {"ratios": ratios, "tolerance": tolerance, "objective": objective}
    out = [candidate_of(choose_scales(stats, g, **opts)) for g in STATIC_GRANULARITIES]
    notes = []
    for g in GROUP_SIZES:
        if ch.head_dim % g == 0:
            out.append(Candidate(f"fp32-group G={g}", False, group_size=g))
        else:
            notes.append(f"fp32-group G={g} left out: {g} does not divide head_dim {ch.head_dim}")
    variants: list[tuple[str | None, bool]] = [
        ("hadamard", True),
        (None, True),
        ("hadamard", False),
    ]
    if ch.rotation is None:
        notes.append(
            f"k-transform with rotation left out: head_dim {ch.head_dim} is not a power of two"
        )
        variants = [(None, True), (None, False)]
    if ch.first_tokens == 0:
        variants = [(r, False) for r, apart in variants if apart]
    for rotation, apart in variants:
        res = choose_k_transform(
            stats, rotation=rotation, first_tokens=apart, centre=centre, **opts
        )
        out.append(candidate_of(res))
    return out, notes


def four_bit_candidates(
    result: CalibrationResult, head_dim: int
) -> tuple[list[Candidate], list[str]]:
    """The 4-bit ``kv_format`` words as the cache would store this model's K and V.

    ``nvfp4`` and ``mxfp4`` (K and V 4-bit, block scales computed as tokens are written),
    ``fp8-k-nvfp4-v`` (K in FP8 with ``result``'s static K scales, V in NVFP4), each where its
    block divides ``head_dim``. Beside the k-transform, K is in its frame with its first tokens
    exact, as the cache stores it (4-bit, or FP8 with its K scales).

    Returns:
        ``(candidates, notes)``: notes say which were left out and why.
    """
    out: list[Candidate] = []
    notes: list[str] = []
    for fmt in FOUR_BIT_FORMATS:
        word, block = fmt.value, fmt.block_size
        if block is None or head_dim % block:
            notes.append(
                f"{word} left out: its {block}-channel blocks do not divide head_dim {head_dim}"
            )
        elif result.granularity == Granularity.K_TRANSFORM:
            kt = candidate_of(result)
            k = kt.k_scale if fmt.fp8_keys else None  # 4-bit K: block scales on write
            out.append(
                replace(kt, name=word, static=False, k_scale=k, v_scale=None, kv_format=word)
            )
        elif fmt.fp8_keys:
            out.append(Candidate(word, False, k_scale=result.k_scales, kv_format=word))
        else:
            out.append(Candidate(word, False, kv_format=word))
    return out, notes


@torch.no_grad()
def evaluate_formats(
    model: torch.nn.Module,
    result: CalibrationResult,
    held_out: Sequence[torch.Tensor],
    *,
    progress: bool = False,
    four_bit: bool = False,
) -> CalibrationReport:
    """Measure every candidate format (and the written one) on held-out windows.

    Args:
        model: the unpatched model ``result`` was calibrated on.
        result: the calibration (its statistics give the candidates' scales).
        held_out: int64 [1, T] token windows not used for the statistics.
        progress: show a tqdm bar on stderr.
        four_bit: also measure the 4-bit ``kv_format`` words (:func:`four_bit_candidates`),
            which a per-layer format map (:mod:`kvquant.calibrate.layer_map`) chooses among.

    Returns:
        The :class:`~kvquant.calibrate.report.CalibrationReport`.

    Raises:
        CalibrationError: no statistics on ``result``, no held-out window, or a
            layer the evaluation never reached.
    """
    from tqdm import tqdm

    stats = result.statistics
    if stats is None or stats.channels is None or not held_out:
        raise CalibrationError(
            "evaluate_formats: needs the result's statistics (with channel statistics) and at "
            f"least one held-out window; got statistics={stats is not None}, "
            f"{len(held_out)} windows. Fix: calibrate with held_out_tokens > 0 and 2+ samples."
        )
    candidates, notes = candidate_formats(
        stats,
        ratios=result.ratios,
        tolerance=result.tolerance,
        objective=result.objective,
        centre=result.centre or "mean",
    )
    chosen = candidate_of(result)
    names = [c.name for c in candidates]
    if chosen.name in names and result.granularity == Granularity.K_TRANSFORM:
        candidates[names.index(chosen.name)] = chosen  # the written one, its own centre
    elif chosen.name not in names:
        candidates.append(chosen)
    if four_bit:
        more, why = four_bit_candidates(result, stats.channels.head_dim)
        candidates += more
        notes += why
    names = [c.name for c in candidates]
    evaluator = FormatEvaluator(
        tuple(candidates), names.index(chosen.name), stats.num_layers, stats.num_kv_heads
    )
    device = next(model.parameters()).device
    decoder: Any = getattr(model, "model", model)
    total = sum(int(w.numel()) for w in held_out)
    with (
        observing(model, evaluator),
        tqdm(
            total=total, desc="held-out", unit="tok", file=sys.stderr, disable=not progress
        ) as bar,
    ):
        for ids in held_out:
            decoder(input_ids=ids.to(device), use_cache=False)
            evaluator.num_tokens += int(ids.numel())
            bar.update(int(ids.numel()))
    return evaluator.report(
        stats.channels.near_constant_share(), chosen.name, notes, held_out_windows=len(held_out)
    )

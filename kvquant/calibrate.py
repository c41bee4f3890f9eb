"""``kvquant calibrate``: static FP8 KV scales for a checkpoint that has none, chosen by their error.

Pipeline:

1. **Statistics** (:class:`KVStatistics`): the model runs over real calibration
   text, window by window, with a small attention function registered in
   transformers' ``AttentionInterface`` that sees the K/V exactly as attention
   does (keys after RoPE, before the GQA repeat) and then calls SDPA. Per layer,
   KV head and kind (K or V) it keeps the amax and a fixed-size histogram of
   ``|x|`` with logarithmic bins (:data:`BINS_PER_OCTAVE` bins per power of two
   from ``2**LOG2_MIN`` to ``2**LOG2_MAX``; counts in fp64). Activations are
   never stored: memory is fixed by the model's geometry, not by the text length.
2. **Search** (:func:`search_ratios`): for every clipping ratio ``r`` of a grid in
   ``[0.5, 1.0]`` the scale is ``s = r * amax / 448`` and the expected squared
   error of FP8 e4m3 quantization is computed from the histogram: every bin
   centre ``c`` is quantized with torch's own cast,
   ``q = fp8_e4m3fn(clamp(c / s, -448, 448)) * s``, and ``(c - q)**2`` is
   weighted by the bin's count. Values above ``r * amax`` saturate at ``448 * s``
   (clipping error); the rest pay the rounding error of the e4m3 grid at that
   scale (subnormals and flush-to-zero included). K and V are searched
   separately, per layer (``per-tensor``, heads pooled) or per layer and KV head
   (``per-head``). The chosen ratio is the *largest* one whose expected MSE is
   within ``tolerance`` (relative, default 0) of the grid minimum, so ``r = 1.0``
   (``amax / 448``) is kept unless a smaller scale lowers the expected error.
   ``objective="attention"`` weighs every value by its first-order effect on the
   attention output instead of counting it once (:func:`attention_weights`).
3. **Writing** (:func:`write_calibrated_checkpoint`): a copy of the checkpoint
   with the scales in a producer convention (compressed-tensors, ModelOpt or
   Quark with ``kv_cache_post_rope: true``) and the matching config, written
   with :mod:`kvquant.export`'s machinery (temporary folder, re-discovery check,
   atomic rename).

The **k-transform** (:func:`choose_k_transform`): per-channel K statistics
(:class:`ChannelStatistics`, bounded too) give a per-channel offset ``c`` of the
Hadamard-rotated K (the first tokens of every window left out) and the per-head
K scale of ``k R - c``; written in kvquant's own convention (``k_offset`` tensors
and ``kvquant_kv_transform.json``).

The **report** (:func:`evaluate_formats`, :mod:`kvquant.calibration_report`):
:func:`calibrate` holds out its last windows and measures every candidate format
on them (relative attention-output error per layer and head, clipping and
subnormal fractions, near-constant K energy, a recommendation).

Calibration data: :func:`load_text_files` and :func:`load_dataset_samples` (the
``datasets`` library, optional) give :class:`CalibrationData`: token windows and
a description of where they came from, for the report and the written metadata.

``benchmarks/accuracy_table.py`` (in the source checkout) measures the calibrated formats on
SmolLM2-135M (docs/accuracy.md). Transformers is imported lazily.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvquant.calibration_report import (
    GROUP_SIZES,
    CalibrationReport,
    Candidate,
    FormatEvaluator,
    hadamard_matrix,
    near_constant_share,
)
from kvquant.checkpoint import producers
from kvquant.checkpoint.writer import (
    CheckpointEdit,
    FileContent,
    check_output_path,
    kv_scale_tensors,
)
from kvquant.errors import CalibrationError, UnsupportedModelError

__all__ = [
    "BINS_PER_OCTAVE",
    "CENTRES",
    "CONVENTIONS",
    "DEFAULT_RATIOS",
    "FP8_E4M3_MAX",
    "LOG2_MAX",
    "LOG2_MIN",
    "MAX_TEXT_BYTES",
    "OBJECTIVES",
    "CalibrationData",
    "CalibrationResult",
    "ChannelStatistics",
    "KVStatistics",
    "LayerCalibration",
    "attention_weights",
    "calibrate",
    "candidate_formats",
    "check_text_file",
    "choose_k_transform",
    "choose_scales",
    "collect_statistics",
    "evaluate_formats",
    "expected_mse",
    "load_dataset_samples",
    "load_text_files",
    "search_ratios",
    "write_calibrated_checkpoint",
]

FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""

BINS_PER_OCTAVE = 64
"""Histogram bins per power of two (bin width ~1.1 % of the value; the e4m3 grid step is 6-12 %)."""

LOG2_MIN = -24
"""Values below ``2**LOG2_MIN`` (and zeros) fall into bin 0, counted as exact zeros."""

LOG2_MAX = 20
"""Values above ``2**LOG2_MAX`` fall into the last bin (their amax is still exact)."""

DEFAULT_RATIOS: tuple[float, ...] = tuple(round(0.5 + 0.01 * i, 2) for i in range(51))
"""The clipping ratios searched by default: 0.50, 0.51, ..., 1.00."""

CONVENTIONS: tuple[str, ...] = ("compressed-tensors", "modelopt", "quark", "kvquant")
"""Conventions :func:`write_calibrated_checkpoint` writes (``kvquant``: the k-transform only)."""

CALIBRATION_ATTENTION = "kvquant_calibrate"
"""Name under which the statistics-collecting attention function is registered."""

OBJECTIVES: tuple[str, ...] = ("mse", "attention")
"""What the ratio search minimises (see :func:`choose_scales`)."""

_OBJECTIVE_TEXT = {
    "mse": "expected FP8 e4m3 MSE of K and of V (clipping + rounding)",
    "attention": "attention-weighted expected FP8 e4m3 squared error of K and of V",
}
CENTRES: tuple[str, ...] = ("mean", "midrange")
"""Per-channel centres the k-transform's offset can be (see :meth:`ChannelStatistics.k_transform`)."""

ROTATIONS: tuple[str | None, ...] = ("hadamard", None)
"""K rotations of the k-transform: the normalised Hadamard matrix, or none (offset only)."""

K_TRANSFORM = "k-transform"
_COLLECT_ATTR = "_kvquant_calibrate"
_REPORT_FILE = "kvquant-calibration.json"
_GRANULARITIES = ("per-tensor", "per-head")
_FORMATS = (*_GRANULARITIES, K_TRANSFORM)


# ---------------------------------------------------------------------------
# statistics


def _num_bins() -> int:
    return (LOG2_MAX - LOG2_MIN) * BINS_PER_OCTAVE


def bin_centres() -> torch.Tensor:
    """Representative value of every histogram bin.

    Returns:
        fp64 [num_bins]: 0 for bin 0 (zeros and values below ``2**LOG2_MIN``),
        else the geometric centre of the bin.
    """
    i = torch.arange(_num_bins(), dtype=torch.float64)
    centres = torch.exp2(LOG2_MIN + (i + 0.5) / BINS_PER_OCTAVE)
    centres[0] = 0.0
    return centres


@dataclass
class ChannelStatistics:
    """Per-channel post-RoPE K statistics for the K transform, with bounded memory.

    Tokens fall in two parts: the first ``first_tokens`` positions of every
    window (part 0: attended from full precision by the k-transform) and the
    rest (part 1). Per part, layer, KV head and channel it keeps the count, sum,
    sum of squares, min and max of K as the cache sees it (model frame) and, when
    head_dim is a power of two, the sum, min and max of ``K @ H`` (H the
    normalised Hadamard matrix: the rotated frame).

    Attributes:
        num_layers: decoder layers.
        num_kv_heads: KV heads per layer.
        head_dim: channels per head.
        first_tokens: positions of every window counted in part 0.
        rotation: fp32 [D, D] Hadamard matrix, or None when D is not a power of two.
        count: int64 [2, L], tokens per part and layer.
        total: fp64 [2, L, H, D] per-channel sums (model frame); ``total_sq`` of squares.
        low / high: fp32 [2, L, H, D] per-channel min / max (model frame).
        rot_total, rot_low, rot_high: the same in the rotated frame (or None).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    first_tokens: int = 1
    rotation: torch.Tensor | None = field(init=False, default=None)
    count: torch.Tensor = field(init=False)
    total: torch.Tensor = field(init=False)
    total_sq: torch.Tensor = field(init=False)
    low: torch.Tensor = field(init=False)
    high: torch.Tensor = field(init=False)
    rot_total: torch.Tensor = field(init=False)
    rot_low: torch.Tensor = field(init=False)
    rot_high: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        if self.first_tokens < 0:
            raise CalibrationError(
                f"ChannelStatistics: first_tokens={self.first_tokens}; expected >= 0. "
                "Fix: pass 0 (no token kept apart) or a small count such as 1."
            )
        shape = (2, self.num_layers, self.num_kv_heads, self.head_dim)
        self.count = torch.zeros((2, self.num_layers), dtype=torch.int64)
        self.total = torch.zeros(shape, dtype=torch.float64)
        self.total_sq = torch.zeros(shape, dtype=torch.float64)
        self.low = torch.full(shape, math.inf)
        self.high = torch.full(shape, -math.inf)
        d = self.head_dim
        if d & (d - 1) == 0:
            self.rotation = hadamard_matrix(d)
        # rotated-frame statistics (left untouched when there is no rotation)
        self.rot_total = torch.zeros_like(self.total)
        self.rot_low = torch.full(shape, math.inf)
        self.rot_high = torch.full(shape, -math.inf)

    @property
    def nbytes(self) -> int:
        """Bytes held (independent of the text length)."""
        tensors = [self.count, self.total, self.total_sq, self.low, self.high]
        tensors += [self.rot_total, self.rot_low, self.rot_high]
        tensors += [self.rotation] if self.rotation is not None else []
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def update(self, layer: int, key: torch.Tensor) -> None:
        """Add one window of one layer's keys: [B, Hkv, T, D], position ``t`` at index ``t``."""
        k = key.detach().float()
        n = min(self.first_tokens, k.shape[2])
        for part, x in ((0, k[:, :, :n]), (1, k[:, :, n:])):
            if x.shape[2] == 0:
                continue
            flat = x.transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_dim)
            self.count[part, layer] += flat.shape[1]
            frames = [(flat, self.total, self.low, self.high)]
            if self.rotation is not None:
                rot = flat @ self.rotation.to(flat.device)
                frames.append((rot, self.rot_total, self.rot_low, self.rot_high))
            for y, tot, low, high in frames:
                tot[part, layer] += y.double().sum(dim=1).cpu()
                low[part, layer] = torch.minimum(low[part, layer], y.amin(dim=1).cpu())
                high[part, layer] = torch.maximum(high[part, layer], y.amax(dim=1).cpu())
            self.total_sq[part, layer] += flat.double().square().sum(dim=1).cpu()

    def near_constant_share(self) -> torch.Tensor:
        """fp64 [L, H]: :func:`kvquant.calibration_report.near_constant_share`, first tokens out."""
        part = 1 if int(self.count[1].sum()) else 0
        return near_constant_share(self.count[part], self.total[part], self.total_sq[part])

    def k_transform(
        self, *, rotate: bool, apart: bool, centre: str = "mean"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel offsets and per-head K scales of the k-transform.

        Args:
            rotate: work in the rotated frame (Hadamard); else the model frame.
            apart: leave the first tokens out (they are attended exactly);
                else every token counts.
            centre: ``"mean"`` or ``"midrange"`` (``(min + max) / 2``) per channel.

        Returns:
            ``(k_offset fp32 [L, H, D], k_scale fp32 [L, H])`` with
            ``k_scale = max_channels max(high - c, c - low) / 448``: the amax of
            ``k R - c`` over the calibration tokens (nothing clips on them).

        Raises:
            CalibrationError: rotation without a power-of-two head_dim, an unknown
                centre, or no token in the parts used.
        """
        if centre not in CENTRES:
            raise CalibrationError(
                f"k-transform: centre {centre!r}; expected one of {CENTRES}. Fix: pass 'mean'."
            )
        if rotate and self.rotation is None:
            hadamard_matrix(self.head_dim)  # raises the power-of-two error
        parts = [1] if apart else [0, 1]
        count = self.count[parts].sum(dim=0)
        empty = [i for i in range(self.num_layers) if int(count[i]) == 0]
        if empty:
            raise CalibrationError(
                f"k-transform: layers {empty[:8]} saw no token after the first "
                f"{self.first_tokens} of each window; expected calibration windows longer than "
                "first_tokens. Fix: pass longer calibration samples or fewer first tokens."
            )
        if rotate:
            tot, low, high = self.rot_total, self.rot_low, self.rot_high
        else:
            tot, low, high = self.total, self.low, self.high
        lo = low[parts].amin(dim=0)
        hi = high[parts].amax(dim=0)
        if centre == "mean":
            c = (tot[parts].sum(dim=0) / count.double().view(-1, 1, 1)).float()
        else:
            c = (lo + hi) / 2
        amax = torch.maximum(hi - c, c - lo).amax(dim=-1)
        scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
        return c.contiguous(), scale.float().contiguous()


@dataclass
class KVStatistics:
    """Running post-RoPE K/V statistics with bounded memory.

    Memory is ``2 * num_layers * num_kv_heads * (num_bins + 2)`` numbers (twice
    the histograms with ``weighted=True``) whatever the amount of text (:attr:`nbytes`).

    With ``weighted=True`` a second pair of histograms accumulates, per bin, the
    *attention weights* of the values instead of their count (see
    :func:`attention_weights`): the ``"attention"`` objective of :func:`choose_scales`.

    Attributes:
        num_layers: decoder layers.
        num_kv_heads: KV heads per layer.
        weighted: whether the attention-weighted histograms are kept.
        channels: per-channel K statistics for the k-transform and the report
            (:class:`ChannelStatistics`), or None.
        k_amax: fp32 [num_layers, num_kv_heads], max |K| seen.
        v_amax: fp32 [num_layers, num_kv_heads], max |V| seen.
        k_hist: fp64 [num_layers, num_kv_heads, num_bins], counts of |K| per log bin.
        v_hist: fp64 [num_layers, num_kv_heads, num_bins], counts of |V|.
        k_whist: fp64 like ``k_hist``, attention weights of |K| per bin (``weighted`` only).
        v_whist: fp64 like ``v_hist`` (``weighted`` only).
        updates: int64 [num_layers], how many forward calls reached each layer.
        nonfinite: NaN/inf values seen (excluded from the statistics).
        num_tokens: tokens run through the model.
        num_samples: forward passes (calibration samples) run through the model.
    """

    num_layers: int
    num_kv_heads: int
    weighted: bool = False
    channels: ChannelStatistics | None = None
    k_amax: torch.Tensor = field(init=False)
    v_amax: torch.Tensor = field(init=False)
    k_hist: torch.Tensor = field(init=False)
    v_hist: torch.Tensor = field(init=False)
    k_whist: torch.Tensor | None = field(init=False, default=None)
    v_whist: torch.Tensor | None = field(init=False, default=None)
    updates: torch.Tensor = field(init=False)
    nonfinite: int = 0
    num_tokens: int = 0
    num_samples: int = 0

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_kv_heads < 1:
            raise CalibrationError(
                f"KVStatistics: {self.num_layers} layers x {self.num_kv_heads} KV heads; "
                "expected at least one of each. Fix: pass the model's geometry."
            )
        shape = (self.num_layers, self.num_kv_heads)
        self.k_amax = torch.zeros(shape, dtype=torch.float32)
        self.v_amax = torch.zeros(shape, dtype=torch.float32)
        self.k_hist = torch.zeros((*shape, _num_bins()), dtype=torch.float64)
        self.v_hist = torch.zeros((*shape, _num_bins()), dtype=torch.float64)
        if self.weighted:
            self.k_whist = torch.zeros_like(self.k_hist)
            self.v_whist = torch.zeros_like(self.v_hist)
        self.updates = torch.zeros(self.num_layers, dtype=torch.int64)

    @property
    def nbytes(self) -> int:
        """Bytes held by the statistics tensors (independent of the text length)."""
        tensors = [self.k_amax, self.v_amax, self.k_hist, self.v_hist, self.updates]
        tensors += [t for t in (self.k_whist, self.v_whist) if t is not None]
        extra = self.channels.nbytes if self.channels is not None else 0
        return extra + sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def update(
        self,
        layer: int,
        key: torch.Tensor,
        value: torch.Tensor,
        key_weight: torch.Tensor | None = None,
        value_weight: torch.Tensor | None = None,
    ) -> None:
        """Add one chunk of one layer's K and V.

        Args:
            layer: decoder layer index.
            key: [B, Hkv, T, D] keys as attention sees them (post-RoPE), any float dtype.
            value: [B, Hkv, T, D] values.
            key_weight: [B, Hkv, T, D] non-negative weight of every key element
                (required when ``weighted``, ignored otherwise).
            value_weight: [B, Hkv, T, D] weight of every value element.

        Raises:
            CalibrationError: layer out of range, a head count other than
                ``num_kv_heads``, or missing weights for weighted statistics.
        """
        if self.weighted and (key_weight is None or value_weight is None):
            raise CalibrationError(
                "KVStatistics.update: weighted statistics need key_weight and value_weight; "
                "got None. Fix: collect with objective='attention' (collect_statistics)."
            )
        if not 0 <= layer < self.num_layers:
            raise CalibrationError(
                f"KVStatistics.update: layer {layer}; expected 0..{self.num_layers - 1}. "
                "Fix: build the statistics for this model's geometry."
            )
        for name, x, amax, hist, weight, whist in (
            ("key", key, self.k_amax, self.k_hist, key_weight, self.k_whist),
            ("value", value, self.v_amax, self.v_hist, value_weight, self.v_whist),
        ):
            if x.dim() != 4 or x.shape[1] != self.num_kv_heads:
                raise CalibrationError(
                    f"KVStatistics.update: layer {layer} {name} has shape {tuple(x.shape)}; "
                    f"expected [B, {self.num_kv_heads}, T, D] (HF layout, KV heads on dim 1). "
                    "Fix: collect from a model with this geometry."
                )
            a = x.detach().float().abs().transpose(0, 1).reshape(self.num_kv_heads, -1)
            finite = torch.isfinite(a)
            bad = int((~finite).sum())
            if bad:
                self.nonfinite += bad
                a = torch.where(finite, a, torch.zeros_like(a))
            amax[layer] = torch.maximum(amax[layer], a.amax(dim=1).cpu())
            idx = torch.floor((torch.log2(a) - LOG2_MIN) * BINS_PER_OCTAVE)
            idx = idx.clamp(0, _num_bins() - 1).long()
            if bad:
                # non-finite entries were zeroed: take them out of bin 0 again
                idx = torch.where(finite, idx, torch.full_like(idx, -1))
            offset = torch.arange(self.num_kv_heads, device=idx.device)[:, None] * _num_bins()
            keep = idx >= 0
            flat = (idx + offset)[keep]
            size = self.num_kv_heads * _num_bins()
            counts = torch.bincount(flat, minlength=size)
            hist[layer] += counts.view(self.num_kv_heads, -1).to("cpu", torch.float64)
            if whist is not None and weight is not None:
                w = weight.detach().double().transpose(0, 1).reshape(self.num_kv_heads, -1)
                wsum = torch.bincount(flat, weights=w[keep], minlength=size)
                whist[layer] += wsum.view(self.num_kv_heads, -1).to("cpu", torch.float64)
        if self.channels is not None:
            self.channels.update(layer, key)
        self.updates[layer] += 1


@torch.no_grad()
def attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float,
    *,
    block: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """How much an error in each K and V element moves the attention output (first order).

    With causal probabilities ``p_ij = softmax_j(scaling * q_i . k_j)``, independent
    errors ``dv_j`` change output ``i`` by ``sum_j p_ij dv_j`` (squared norm
    ``~ sum_j p_ij**2 |dv_j|**2``), and an error ``dk_jc`` changes logit ``ij`` by
    ``scaling * q_ic dk_jc``, which moves the output by about ``p_ij`` times that.
    Hence the weights, summed over the query heads sharing a KV head:

    * V element ``(j, c)``: ``sum_i p_ij**2``;
    * K element ``(j, c)``: ``scaling**2 * sum_i p_ij**2 * q_ic**2``.

    Queries are processed ``block`` rows at a time (memory ``O(block * T)`` per head).

    Args:
        query: [B, Hq, Tq, D] queries (post-RoPE), Hq a multiple of Hkv.
        key: [B, Hkv, Tk, D] keys (post-RoPE), Tk >= Tq; the queries are the last
            Tq positions (causal).
        scaling: the softmax scale (``module.scaling``, usually ``D**-0.5``).
        block: query rows per step.

    Returns:
        ``(key_weight, value_weight)``, both fp32 [B, Hkv, Tk, D].
    """
    b, hq, tq, d = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    group = hq // hkv
    q = query.float()
    k = key.float().repeat_interleave(group, dim=1)
    wk = torch.zeros(b, hq, tk, d, dtype=torch.float32, device=q.device)
    wv = torch.zeros(b, hq, tk, dtype=torch.float32, device=q.device)
    cols = torch.arange(tk, device=q.device)
    for i0 in range(0, tq, block):
        qi = q[:, :, i0 : i0 + block]
        rows = torch.arange(i0, i0 + qi.shape[2], device=q.device) + (tk - tq)
        scores = (qi @ k.transpose(-1, -2)) * scaling
        scores = scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        p2 = torch.softmax(scores, dim=-1).square()
        wv += p2.sum(dim=2)
        wk += p2.transpose(-1, -2) @ qi.square()
    wk = (wk * scaling**2).view(b, hkv, group, tk, d).sum(dim=2)
    wv = wv.view(b, hkv, group, tk).sum(dim=2)
    return wk, wv[..., None].expand(b, hkv, tk, d)


# ---------------------------------------------------------------------------
# error model and search


def expected_mse(
    hist: torch.Tensor,
    amax: torch.Tensor,
    ratios: Sequence[float] | torch.Tensor,
) -> torch.Tensor:
    """Expected FP8 e4m3 squared error per value for each clipping ratio, from histograms.

    For ratio ``r`` the scale is ``s = r * amax / 448``; each bin centre ``c`` is
    quantized as the cache does (``fp8_e4m3fn(clamp(c / s, -448, 448)) * s``, the
    division in fp32) and ``(c - q)**2`` is averaged with the bin counts as weights.

    Args:
        hist: fp64 [N, num_bins] counts (N independent distributions).
        amax: [N] max |x| of each distribution.
        ratios: [R] clipping ratios in (0, 1].

    Returns:
        fp64 [N, R] mean squared error per value (0 for empty or all-zero rows).
    """
    r = torch.as_tensor(ratios, dtype=torch.float32)
    centres = bin_centres()
    c32 = centres.float()
    amax32 = amax.float()
    total = hist.sum(dim=1)
    out = torch.zeros((hist.shape[0], r.shape[0]), dtype=torch.float64)
    for j in range(r.shape[0]):
        s = amax32 * r[j] / FP8_E4M3_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = (c32[None, :] / s[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        q = q.to(torch.float8_e4m3fn).float() * s[:, None]
        err = (centres[None, :] - q.double()) ** 2
        out[:, j] = (hist * err).sum(dim=1) / total.clamp_min(1.0)
    return out


def _saturation(hist: torch.Tensor, amax: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """Estimated fraction of values above ``ratio * amax`` (saturated): fp64 [N].

    Whole bins above the threshold count fully; the bin holding the threshold
    counts by the share of its (logarithmic) width above it; nothing saturates
    at ``ratio == 1``.
    """
    n = _num_bins()
    threshold = (amax.double() * ratio.double()).clamp_min(2.0**LOG2_MIN)
    lower = LOG2_MIN + torch.arange(n, dtype=torch.float64) / BINS_PER_OCTAVE
    # share of each bin [lower, lower + 1/bpo) lying above log2(threshold)
    above = (
        (lower[None, :] + 1.0 / BINS_PER_OCTAVE - torch.log2(threshold)[:, None]) * BINS_PER_OCTAVE
    ).clamp(0.0, 1.0)
    above[:, 0] = 0.0  # bin 0 holds zeros
    sat = (hist * above).sum(dim=1) / hist.sum(dim=1).clamp_min(1.0)
    return torch.where(ratio >= 1.0, torch.zeros_like(sat), sat)


def search_ratios(
    hist: torch.Tensor,
    amax: torch.Tensor,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    *,
    tolerance: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick a clipping ratio per distribution by expected FP8 MSE.

    Args:
        hist: fp64 [N, num_bins] histogram counts.
        amax: [N] max |x|.
        ratios: candidate ratios (searched in ascending order); must contain 1.0.
        tolerance: keep the largest ratio whose MSE is at most ``(1 + tolerance)``
            times the minimum over the grid (0: the exact argmin, largest on ties).

    Returns:
        ``(chosen_ratio fp32 [N], mse fp64 [N, R])`` with ``mse`` in ascending-ratio order.

    Raises:
        CalibrationError: ratios outside (0, 1], without 1.0, or a negative tolerance.
    """
    grid = _check_grid(ratios, tolerance)
    idx, mse = _search(hist, amax, grid, tolerance)
    return torch.tensor(grid, dtype=torch.float32)[idx], mse


def _check_grid(ratios: Sequence[float], tolerance: float) -> tuple[float, ...]:
    """The sorted ratio grid, or :class:`CalibrationError` for a bad grid or tolerance."""
    grid = tuple(sorted({float(r) for r in ratios}))
    if not grid or grid[0] <= 0.0 or grid[-1] != 1.0:
        raise CalibrationError(
            f"search_ratios: ratios {list(grid[:3])}...{list(grid[-3:])} must lie in (0, 1] and "
            "include 1.0 (the amax / 448 scale). Fix: pass e.g. kvquant.calibrate.DEFAULT_RATIOS."
        )
    if not tolerance >= 0.0:
        raise CalibrationError(
            f"search_ratios: tolerance {tolerance}; expected >= 0. Fix: pass 0.0 or a small "
            "relative margin such as 0.01."
        )
    return grid


def _search(
    hist: torch.Tensor, amax: torch.Tensor, grid: Sequence[float], tolerance: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index into ``grid`` (ascending) of the chosen ratio per row: int64 [N], and the MSE table."""
    mse = expected_mse(hist, amax, grid)
    best = mse.min(dim=1, keepdim=True).values
    ok = mse <= best * (1.0 + tolerance)
    idx = torch.arange(len(grid)).expand_as(ok)
    return torch.where(ok, idx, torch.full_like(idx, -1)).amax(dim=1), mse


# ---------------------------------------------------------------------------
# result


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
        report: the :class:`~kvquant.calibration_report.CalibrationReport`
            measured on held-out windows, or None when none was held out.
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
        if self.granularity == K_TRANSFORM:
            rot = "Hadamard-rotated K" if self.rotation == "hadamard" else "K (no rotation)"
            return (
                f"k-transform: {rot} minus a per-channel offset (the {self.centre} over the "
                f"calibration tokens, the first {self.first_tokens} of each window left out), "
                "K scale = amax of the result / 448 per head; V: "
                + (
                    "scale = amax / 448 per head"
                    if self.ratios == (1.0,)
                    else f"per-head clipping search minimising the {_OBJECTIVE_TEXT[self.objective]}"
                )
            )
        if self.observer == "minmax":
            return "scale = amax / 448 (no clipping search)"
        return (
            f"clipping search: scale = r * amax / 448 with r in [{min(self.ratios):.2f}, "
            f"{max(self.ratios):.2f}] ({len(self.ratios)} values) minimising the "
            f"{_OBJECTIVE_TEXT[self.objective]}"
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
        from dataclasses import replace

        return replace(self, report=report)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (scales as lists, statistics left out)."""
        return {
            "granularity": self.granularity,
            "observer": self.observer,
            "method": self.method,
            "objective": self.objective,
            "objective_description": _OBJECTIVE_TEXT[self.objective],
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
                if self.granularity == K_TRANSFORM
                else {}
            ),
            "report": self.report.to_dict() if self.report is not None else None,
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
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def _fmt_ratios(values: tuple[float, ...]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return "/".join(f"{v:.2f}" for v in values)


def choose_scales(
    stats: KVStatistics,
    granularity: str = "per-tensor",
    *,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    tolerance: float = 0.0,
    objective: str = "mse",
    texts: Sequence[str] = (),
) -> CalibrationResult:
    """Choose scales from collected statistics (no model needed).

    Args:
        stats: statistics from :func:`collect_statistics`.
        granularity: ``"per-tensor"`` (one ratio per layer and kind, heads pooled)
            or ``"per-head"`` (one per layer, KV head and kind).
        ratios: ratio grid (must contain 1.0); ``(1.0,)`` gives plain ``amax / 448``.
        tolerance: relative MSE margin, see :func:`search_ratios`.
        objective: ``"mse"`` (every value counts once) or ``"attention"`` (values
            weighted by :func:`attention_weights`; needs ``stats.weighted``).
        texts: names of the calibration texts, for the report.

    Returns:
        A :class:`CalibrationResult`.

    Raises:
        CalibrationError: unknown granularity or objective, or a layer never saw any K/V.
    """
    if objective not in OBJECTIVES:
        raise CalibrationError(
            f"choose_scales: objective {objective!r}; expected one of {OBJECTIVES}. "
            "Fix: pass 'mse' or 'attention'."
        )
    if objective == "attention" and not stats.weighted:
        raise CalibrationError(
            "choose_scales: objective 'attention' needs attention-weighted statistics but "
            "these were collected unweighted. Fix: collect_statistics(..., objective='attention')."
        )
    if granularity not in _GRANULARITIES:
        raise CalibrationError(
            f"choose_scales: granularity {granularity!r}; expected one of {_GRANULARITIES}. "
            "Fix: fp32-group scales are dynamic and need no calibration."
        )
    missing = [i for i in range(stats.num_layers) if int(stats.updates[i]) == 0]
    if missing:
        raise CalibrationError(
            f"choose_scales: layers {missing[:8]} never saw K/V; expected every layer to run. "
            "Fix: collect statistics over at least one forward of the whole model."
        )
    grid = _check_grid(ratios, tolerance)
    L, H = stats.num_layers, stats.num_kv_heads
    picked: dict[str, tuple[torch.Tensor, ...]] = {}
    for kind, hist, whist, amax in (
        ("k", stats.k_hist, stats.k_whist, stats.k_amax),
        ("v", stats.v_hist, stats.v_whist, stats.v_amax),
    ):
        weights = whist if objective == "attention" and whist is not None else hist
        if granularity == "per-tensor":
            h = hist.sum(dim=1)  # [L, NB]
            hw = weights.sum(dim=1)
            a = amax.amax(dim=1)  # [L]
        else:
            h = hist.reshape(L * H, -1)
            hw = weights.reshape(L * H, -1)
            a = amax.reshape(L * H)
        chosen_idx, mse = _search(hw, a, grid, tolerance)
        ratio = torch.tensor(grid, dtype=torch.float32)[chosen_idx]
        scale = a * ratio / FP8_E4M3_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale)).float()
        counts = h.sum(dim=1)
        mass = hw.sum(dim=1)
        mse_chosen = mse.gather(1, chosen_idx[:, None])[:, 0] * mass
        mse_amax = mse[:, -1] * mass
        sat = _saturation(h, a, ratio) * counts
        shape: tuple[int, ...] = (L,)
        if granularity == "per-head":
            shape = (L, H)
            mse_chosen, mse_amax, sat, counts = (
                t.view(L, H).sum(dim=1) for t in (mse_chosen, mse_amax, sat, counts)
            )
        picked[kind] = (
            scale.view(shape),
            ratio.view(L, -1),
            a.view(L, -1),
            sat / counts.clamp_min(1.0),
            torch.where(mse_amax > 0, mse_chosen / mse_amax, torch.ones_like(mse_amax)),
        )
    layers = tuple(
        LayerCalibration(
            layer=i,
            k_ratio=tuple(float(x) for x in picked["k"][1][i]),
            v_ratio=tuple(float(x) for x in picked["v"][1][i]),
            k_saturation=float(picked["k"][3][i]),
            v_saturation=float(picked["v"][3][i]),
            k_mse_vs_amax=float(picked["k"][4][i]),
            v_mse_vs_amax=float(picked["v"][4][i]),
            k_amax=tuple(float(x) for x in picked["k"][2][i]),
            v_amax=tuple(float(x) for x in picked["v"][2][i]),
        )
        for i in range(L)
    )
    return CalibrationResult(
        granularity=granularity,
        k_scales=picked["k"][0].contiguous(),
        v_scales=picked["v"][0].contiguous(),
        layers=layers,
        num_tokens=stats.num_tokens,
        num_kv_heads=H,
        ratios=grid,
        tolerance=tolerance,
        objective=objective,
        texts=tuple(texts),
        statistics=stats,
        num_samples=stats.num_samples,
    )


def _k_transform_name(rotation: str | None, first_tokens: int) -> str:
    rot = "hadamard" if rotation == "hadamard" else "offset only"
    first = "first tokens" if first_tokens else "no first tokens"
    return f"k-transform ({rot}, {first})"


def choose_k_transform(
    stats: KVStatistics,
    *,
    rotation: str | None = "hadamard",
    first_tokens: bool = True,
    centre: str = "mean",
    ratios: Sequence[float] = DEFAULT_RATIOS,
    tolerance: float = 0.0,
    objective: str = "mse",
    texts: Sequence[str] = (),
) -> CalibrationResult:
    """The static K transform from collected statistics (no model needed).

    Per layer and KV head: rotate K (``rotation="hadamard"``; None: identity),
    offset ``c`` = the per-channel ``centre`` of ``k R`` over the calibration
    tokens (the first ``stats.channels.first_tokens`` of each window left out
    when ``first_tokens``: the attention reads them exactly), K scale = amax of
    ``k R - c`` / 448 (:meth:`ChannelStatistics.k_transform`). V: per-head, by
    the same search as :func:`choose_scales`.

    Args:
        stats: statistics from :func:`collect_statistics` (with channel statistics).
        rotation: ``"hadamard"`` or None.
        first_tokens: keep the first tokens apart (``stats.channels.first_tokens``
            of them); False: none, every token counts.
        centre: ``"mean"`` or ``"midrange"``.
        ratios: ratio grid of the V search.
        tolerance: relative MSE margin of the V search.
        objective: objective of the V search.
        texts: names of the calibration texts, for the report.

    Returns:
        A :class:`CalibrationResult` with granularity ``"k-transform"``.

    Raises:
        CalibrationError: no channel statistics, an unknown rotation or centre,
            rotation with a head_dim that is not a power of two, or bad search options.
    """
    ch = stats.channels
    if ch is None:
        raise CalibrationError(
            "choose_k_transform: these statistics have no per-channel K statistics; expected "
            "them for the k-transform. Fix: collect with collect_statistics (it keeps them)."
        )
    if rotation not in ROTATIONS:
        raise CalibrationError(
            f"choose_k_transform: rotation {rotation!r}; expected 'hadamard' or None. "
            "Fix: pass one of those."
        )
    apart = first_tokens and ch.first_tokens > 0
    offset, k_scale = ch.k_transform(rotate=rotation == "hadamard", apart=apart, centre=centre)
    head = choose_scales(
        stats, "per-head", ratios=ratios, tolerance=tolerance, objective=objective, texts=texts
    )
    layers = tuple(
        LayerCalibration(
            layer=lay.layer,
            k_ratio=(1.0,) * stats.num_kv_heads,
            v_ratio=lay.v_ratio,
            k_saturation=0.0,
            v_saturation=lay.v_saturation,
            k_mse_vs_amax=1.0,
            v_mse_vs_amax=lay.v_mse_vs_amax,
            k_amax=tuple(float(x) * FP8_E4M3_MAX for x in k_scale[lay.layer]),
            v_amax=lay.v_amax,
        )
        for lay in head.layers
    )
    from dataclasses import replace

    return replace(
        head,
        granularity=K_TRANSFORM,
        k_scales=k_scale,
        layers=layers,
        k_offset=offset,
        rotation=rotation,
        first_tokens=ch.first_tokens if apart else 0,
        centre=centre,
    )


def _candidate_of(result: CalibrationResult, name: str | None = None) -> Candidate:
    """The report's simulation of a static result."""
    if result.granularity != K_TRANSFORM:
        return Candidate(
            name or result.granularity, True, k_scale=result.k_scales, v_scale=result.v_scales
        )
    rot = None
    if result.rotation == "hadamard" and result.k_offset is not None:
        rot = hadamard_matrix(int(result.k_offset.shape[-1]))
    return Candidate(
        name or _k_transform_name(result.rotation, result.first_tokens),
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
    out = [_candidate_of(choose_scales(stats, g, **opts)) for g in _GRANULARITIES]
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
        out.append(_candidate_of(res))
    return out, notes


@torch.no_grad()
def evaluate_formats(
    model: torch.nn.Module,
    result: CalibrationResult,
    held_out: Sequence[torch.Tensor],
    *,
    progress: bool = False,
) -> CalibrationReport:
    """Measure every candidate format (and the written one) on held-out windows.

    Args:
        model: the unpatched model ``result`` was calibrated on.
        result: the calibration (its statistics give the candidates' scales).
        held_out: int64 [1, T] token windows not used for the statistics.
        progress: show a tqdm bar on stderr.

    Returns:
        The :class:`~kvquant.calibration_report.CalibrationReport`.

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
    chosen = _candidate_of(result)
    names = [c.name for c in candidates]
    if chosen.name in names and result.granularity == K_TRANSFORM:
        candidates[names.index(chosen.name)] = chosen  # the written one, its own centre
    elif chosen.name not in names:
        candidates.append(chosen)
    names = [c.name for c in candidates]
    evaluator = FormatEvaluator(
        tuple(candidates), names.index(chosen.name), stats.num_layers, stats.num_kv_heads
    )
    device = next(model.parameters()).device
    decoder: Any = getattr(model, "model", model)
    total = sum(int(w.numel()) for w in held_out)
    with (
        _collecting(model, evaluator),
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


# ---------------------------------------------------------------------------
# collection through the model


def _collecting_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """Attention function: record K/V statistics, then run transformers' SDPA attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    stats: KVStatistics | FormatEvaluator | None = getattr(module, _COLLECT_ATTR, None)
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = float(getattr(module, "scaling", query.shape[-1] ** -0.5))
    layer = int(getattr(module, "layer_idx", 0))
    if isinstance(stats, FormatEvaluator):
        stats.observe(layer, query, key, value, float(scaling))
    elif stats is not None:
        if stats.weighted:
            wk, wv = attention_weights(query, key, float(scaling))
            stats.update(layer, key, value, wk, wv)
        else:
            stats.update(layer, key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def _collecting(model: torch.nn.Module, stats: KVStatistics | FormatEvaluator) -> Iterator[None]:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    from kvquant.integrations.hf.models import find_attention_sites

    if getattr(model, "_kvquant_state", None) is not None:
        raise CalibrationError(
            f"{type(model).__name__} is patched by kvquant.patch; calibration must see the "
            "unquantized K/V. Fix: call handle.remove() first, or calibrate a fresh model."
        )
    AttentionInterface.register(CALIBRATION_ATTENTION, _collecting_attention)
    AttentionMaskInterface.register(CALIBRATION_ATTENTION, sdpa_mask)
    hf_model: Any = model
    config = hf_model.config
    previous = config._attn_implementation
    mods = [site.module for site in find_attention_sites(model)]
    hf_model.set_attn_implementation(CALIBRATION_ATTENTION)
    try:
        if config._attn_implementation != CALIBRATION_ATTENTION:
            raise UnsupportedModelError(
                f"{type(model).__name__}: attention implementation stayed "
                f"{config._attn_implementation!r} after set_attn_implementation("
                f"{CALIBRATION_ATTENTION!r}); expected the switch to take. Fix: use a model "
                "whose attention calls transformers' AttentionInterface."
            )
        for mod in mods:
            setattr(mod, _COLLECT_ATTR, stats)
        yield
    finally:
        for mod in mods:
            if hasattr(mod, _COLLECT_ATTR):
                delattr(mod, _COLLECT_ATTR)
        hf_model.set_attn_implementation(previous)


def _windows(
    model: torch.nn.Module,
    inputs: Any,
    tokenizer: Any,
    window: int,
    max_tokens: int | None,
) -> list[torch.Tensor]:
    """Turn texts or token ids into int64 [1, <=window] windows, at most ``max_tokens`` in total."""
    if isinstance(inputs, (str, torch.Tensor)):
        inputs = [inputs]
    docs: list[torch.Tensor] = []
    for item in inputs:
        if isinstance(item, str):
            if tokenizer is None:
                raise CalibrationError(
                    "calibrate: texts were given but tokenizer=None; expected a tokenizer to "
                    "turn them into token ids. Fix: pass tokenizer=AutoTokenizer.from_pretrained"
                    "(model_dir), or pass token ids."
                )
            ids = tokenizer(item, return_tensors="pt")["input_ids"].long()
        elif isinstance(item, torch.Tensor):
            if item.dtype not in (torch.int64, torch.int32) or item.dim() not in (1, 2):
                raise CalibrationError(
                    f"calibrate: token ids of dtype {item.dtype} and shape {tuple(item.shape)}; "
                    "expected an integer tensor [T] or [B, T]. Fix: tokenize the text first."
                )
            ids = item.long().reshape(1, -1) if item.dim() == 1 else item.long()
        else:
            raise CalibrationError(
                f"calibrate: got a {type(item).__name__} among the inputs; expected str texts "
                "or int64 token-id tensors. Fix: pass a list of texts or of token ids."
            )
        docs.extend(row for row in ids)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    out: list[torch.Tensor] = []
    budget = max_tokens if max_tokens is not None else sys.maxsize
    for doc in docs:
        if doc.numel() and int(doc.min()) < 0:
            raise CalibrationError(
                f"calibrate: token id {int(doc.min())} is negative; expected ids in "
                "[0, vocab_size) from this model's tokenizer (a padding value such as -100 or "
                "-1 is not a token). Fix: drop padding and labels-style ids from the inputs, or "
                "use the model's tokenizer."
            )
        if vocab is not None and doc.numel() and int(doc.max()) >= int(vocab):
            raise CalibrationError(
                f"calibrate: token id {int(doc.max())} >= the model's vocab_size {vocab}; "
                "expected ids from this model's tokenizer. Fix: use the model's tokenizer."
            )
        for start in range(0, doc.numel(), window):
            piece = doc[start : start + window][:budget]
            if piece.numel() >= 2:
                out.append(piece.view(1, -1))
                budget -= piece.numel()
            if budget <= 0:
                return out
    return out


@torch.no_grad()
def collect_statistics(
    model: torch.nn.Module,
    texts_or_token_ids: str | torch.Tensor | Sequence[str | torch.Tensor],
    *,
    tokenizer: Any = None,
    window: int = 2048,
    max_tokens: int | None = None,
    objective: str = "mse",
    progress: bool = True,
    first_tokens: int = 1,
) -> KVStatistics:
    """Run the model over calibration text and gather post-RoPE K/V statistics.

    Each window is one forward (``use_cache=False``), so K/V are seen at the
    positions a prompt of that length would give them. Besides the histograms,
    per-channel K statistics (:class:`ChannelStatistics`) are kept for the
    k-transform and the calibration report.

    Args:
        model: an unpatched transformers causal LM of a family kvquant supports.
        texts_or_token_ids: a text, token ids int64 [T] or [B, T], or a list of either.
        tokenizer: required when texts are given.
        window: tokens per forward (documents are cut into windows of this size).
        max_tokens: stop after this many tokens (None: all).
        objective: ``"attention"`` also accumulates attention-weighted histograms
            (:func:`attention_weights`; one extra ``QK^T`` per layer); ``"mse"`` does not.
        progress: show a tqdm progress bar on stderr.
        first_tokens: positions of every window kept apart in the channel
            statistics (the k-transform attends them exactly).

    Returns:
        The filled :class:`KVStatistics`.

    Raises:
        CalibrationError: no usable tokens, bad inputs, or a patched model.
        UnsupportedModelError: the model's attention cannot be observed.
    """
    from tqdm import tqdm

    from kvquant.integrations.hf.models import (
        check_supported,
        find_attention_sites,
        model_geometry,
    )

    if objective not in OBJECTIVES:
        raise CalibrationError(
            f"calibrate: objective {objective!r}; expected one of {OBJECTIVES}. "
            "Fix: pass 'mse' or 'attention'."
        )
    if window < 2:
        raise CalibrationError(f"calibrate: window={window}; expected >= 2 tokens.")
    if max_tokens is not None and max_tokens < 2:
        raise CalibrationError(f"calibrate: max_tokens={max_tokens}; expected >= 2 tokens.")
    check_supported(model)  # the written checkpoint must be usable by kvquant.patch
    sites = find_attention_sites(model)
    geometry = model_geometry(model, sites)
    if geometry.layer_num_kv_heads is not None:
        raise CalibrationError(
            f"calibrate: {type(model).__name__} has layers with different KV-head counts "
            f"({geometry.describe()}); kvquant's calibration statistics hold one KV-head count "
            "for every layer. Fix: patch the model without static scales (kvquant.patch(model): "
            "the dynamic fp32-group scales serve every layer geometry)."
        )
    windows = _windows(model, texts_or_token_ids, tokenizer, window, max_tokens)
    if not windows:
        raise CalibrationError(
            "calibrate: the inputs give no window of at least 2 tokens; expected real text. "
            "Fix: pass a longer calibration text."
        )
    channels = ChannelStatistics(
        geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, first_tokens
    )
    stats = KVStatistics(
        geometry.num_layers,
        geometry.num_kv_heads,
        weighted=objective == "attention",
        channels=channels,
    )
    device = next(model.parameters()).device
    decoder: Any = getattr(model, "model", model)
    total = sum(w.numel() for w in windows)
    with (
        _collecting(model, stats),
        tqdm(
            total=total, desc="calibrating", unit="tok", file=sys.stderr, disable=not progress
        ) as bar,
    ):
        for ids in windows:
            decoder(input_ids=ids.to(device), use_cache=False)
            stats.num_tokens += int(ids.numel())
            stats.num_samples += int(ids.shape[0])
            bar.update(int(ids.numel()))
    if stats.nonfinite:
        raise CalibrationError(
            f"calibrate: the model produced {stats.nonfinite} non-finite K/V values on the "
            "calibration text; expected finite activations. Fix: run the model in fp32 (or "
            "bf16) and check its weights; scales from NaN/inf activations are meaningless."
        )
    return stats


def _split_held_out(
    windows: list[torch.Tensor], held_out_tokens: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The last windows holding at least ``held_out_tokens`` tokens, at most a quarter of them.

    At least one window is held out when there are two or more (and
    ``held_out_tokens > 0``); at least one is always kept to calibrate on.
    """
    held: list[torch.Tensor] = []
    count = 0
    most = max(1, len(windows) // 4) if len(windows) > 1 else 0
    while held_out_tokens > 0 and count < held_out_tokens and len(held) < most:
        held.insert(0, windows.pop())
        count += int(held[0].numel())
    return windows, held


def calibrate(
    model: torch.nn.Module,
    texts_or_token_ids: str | torch.Tensor | Sequence[str | torch.Tensor],
    *,
    granularity: str = "per-tensor",
    tokenizer: Any = None,
    window: int = 2048,
    max_tokens: int | None = None,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    tolerance: float = 0.0,
    objective: str = "mse",
    progress: bool = True,
    text_names: Sequence[str] = (),
    rotation: str | None = "hadamard",
    first_tokens: int = 1,
    centre: str = "mean",
    held_out_tokens: int = 512,
) -> CalibrationResult:
    """Calibrate static FP8 KV scales by the expected quantization error they cause.

    The last windows (at least ``held_out_tokens`` tokens, at most a quarter of
    the windows, at least one when there are two or more) are held out; :func:`collect_statistics` runs on the
    rest, then :func:`choose_scales` (per-tensor, per-head) or
    :func:`choose_k_transform` (k-transform), and :func:`evaluate_formats`
    measures every candidate format on the held-out windows (the result's
    ``report``; None when nothing could be held out).

    Args:
        model: an unpatched transformers causal LM of a family kvquant supports.
        texts_or_token_ids: a text, token ids int64 [T] or [B, T], or a list of either.
        granularity: ``"per-tensor"``, ``"per-head"`` or ``"k-transform"``.
        tokenizer: required when texts are given.
        window: tokens per forward.
        max_tokens: stop after this many tokens (None: all).
        ratios: clipping-ratio grid (must contain 1.0).
        tolerance: relative MSE margin that still prefers a larger ratio.
        objective: ``"mse"`` (default: every value counts once) or ``"attention"``
            (errors weighted by their first-order effect on the attention output).
        progress: show a tqdm progress bar.
        text_names: names of the texts, for the report.
        rotation: k-transform: ``"hadamard"`` (head_dim a power of two) or None.
        first_tokens: k-transform: first positions of every sequence attended at
            full precision, left out of the offsets and scales (0: none).
        centre: k-transform: per-channel offset, ``"mean"`` or ``"midrange"``.
        held_out_tokens: tokens held out for the report (0: no report).

    Returns:
        A :class:`CalibrationResult` (scales per layer, canonical fp32, plus the report).

    Raises:
        CalibrationError: bad inputs or options.
        UnsupportedModelError: the model's attention cannot be observed.

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> _ = torch.manual_seed(0)
        >>> model = LlamaForCausalLM(cfg).eval()
        >>> res = calibrate(model, torch.randint(0, 64, (1, 256)), progress=False)
        >>> res.k_scales.shape, res.k_scales.dtype
        (torch.Size([2]), torch.float32)
    """
    if granularity not in _FORMATS:
        raise CalibrationError(
            f"calibrate: granularity {granularity!r}; expected one of {_FORMATS}. "
            "Fix: fp32-group scales are dynamic and need no calibration."
        )
    if held_out_tokens < 0:
        raise CalibrationError(
            f"calibrate: held_out_tokens={held_out_tokens}; expected >= 0. Fix: pass 0 (no "
            "report) or a token count such as 512."
        )
    if granularity == K_TRANSFORM and rotation not in ROTATIONS:
        raise CalibrationError(
            f"calibrate: rotation {rotation!r}; expected 'hadamard' or None. Fix: pass one of those."
        )
    if not 2 <= window:
        raise CalibrationError(f"calibrate: window={window}; expected >= 2 tokens.")
    windows = _windows(model, texts_or_token_ids, tokenizer, window, max_tokens)
    windows, held_out = _split_held_out(windows, held_out_tokens)
    stats = collect_statistics(
        model,
        windows,
        tokenizer=tokenizer,
        window=window,
        objective=objective,
        progress=progress,
        first_tokens=first_tokens,
    )
    opts: dict[str, Any] = {
        "ratios": ratios,
        "tolerance": tolerance,
        "objective": objective,
        "texts": text_names,
    }
    if granularity == K_TRANSFORM:
        result = choose_k_transform(
            stats, rotation=rotation, first_tokens=first_tokens > 0, centre=centre, **opts
        )
    else:
        result = choose_scales(stats, granularity, **opts)
    if not held_out:
        return result
    return result.with_report(evaluate_formats(model, result, held_out, progress=progress))


# ---------------------------------------------------------------------------
# calibration data


@dataclass(frozen=True, eq=False)
class CalibrationData:
    """Calibration samples (token windows) and where they came from.

    Attributes:
        samples: int64 ``[1, T]`` token windows, ``2 <= T <= max_seq_length``;
            each is one forward pass.
        source: a description of the data (files, or dataset, config, split, column).
        max_seq_length: the most tokens per sample.
    """

    samples: tuple[torch.Tensor, ...]
    source: str
    max_seq_length: int

    @property
    def num_samples(self) -> int:
        """Samples (forward passes)."""
        return len(self.samples)

    @property
    def num_tokens(self) -> int:
        """Tokens over all samples."""
        return sum(int(t.numel()) for t in self.samples)


def _check_sizes(num_samples: int | None, max_seq_length: int) -> None:
    if num_samples is not None and num_samples < 1:
        raise CalibrationError(
            f"calibration data: num_samples={num_samples}; expected at least 1. "
            "Fix: pass --num-samples 512 (or another positive count)."
        )
    if max_seq_length < 2:
        raise CalibrationError(
            f"calibration data: max_seq_length={max_seq_length}; expected at least 2 tokens. "
            "Fix: pass --max-seq-length 2048 (or another length >= 2)."
        )


MAX_TEXT_BYTES = 64 * 1024 * 1024
"""Largest calibration text file read (about 16 M tokens; calibration uses far fewer)."""


def check_text_file(file: str | Path) -> int:
    """Check, without opening it, that a calibration text is a bounded regular file.

    Args:
        file: the ``--text`` file.

    Returns:
        Its size in bytes.

    Raises:
        CalibrationError: the file is missing, not a regular file (a FIFO, a
            device such as ``/dev/zero``, a folder), or larger than
            :data:`MAX_TEXT_BYTES`.
    """
    if not isinstance(file, (str, os.PathLike)):
        raise CalibrationError(
            f"calibration data: a text file is a {type(file).__name__}; expected a path."
        )
    try:
        st = os.stat(file)
    except OSError as exc:
        raise CalibrationError(
            f"calibration data: --text {file} cannot be read ({exc.strerror or exc}). "
            "Fix: pass an existing plain-text file."
        ) from exc
    if not stat.S_ISREG(st.st_mode):
        kind = (
            "a folder" if stat.S_ISDIR(st.st_mode)
            else "a FIFO" if stat.S_ISFIFO(st.st_mode)
            else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "not a regular file"
        )  # fmt: skip
        raise CalibrationError(
            f"calibration data: --text {file} is {kind}, expected a regular text file; kvquant "
            "reads calibration text from regular files only. Fix: save the text to a file and "
            "pass that."
        )
    if st.st_size > MAX_TEXT_BYTES:
        raise CalibrationError(
            f"calibration data: --text {file} is {st.st_size} bytes, more than the "
            f"{MAX_TEXT_BYTES} kvquant reads from one text file (calibration uses "
            "--num-samples windows of --max-seq-length tokens, far less). Fix: pass a smaller "
            "sample of the text."
        )
    return int(st.st_size)


def _read_text_file(file: str | Path) -> str:
    size = check_text_file(file)
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise OSError("it changed into a special file")
            blob = fh.read(min(size, MAX_TEXT_BYTES) + 1)
        if len(blob) > MAX_TEXT_BYTES:
            raise OSError(f"it grew beyond {MAX_TEXT_BYTES} bytes while being read")
        return blob.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationError(
            f"calibration data: --text {file} could not be read as UTF-8 text ({exc}). "
            "Fix: pass a readable plain-text file."
        ) from exc


def load_text_files(
    files: Sequence[str | Path],
    tokenizer: Any,
    *,
    num_samples: int | None = None,
    max_seq_length: int = 2048,
    progress: bool = False,
) -> CalibrationData:
    """Calibration samples from UTF-8 text files.

    Each file is tokenized whole and cut into windows of ``max_seq_length``
    tokens (a shorter last window is kept when it has at least 2 tokens).

    Args:
        files: the text files, in order.
        tokenizer: the model's tokenizer.
        num_samples: keep at most this many windows (None: all).
        max_seq_length: tokens per window.
        progress: show a tqdm bar over the files on stderr.

    Returns:
        The :class:`CalibrationData`.

    Raises:
        CalibrationError: no file, a file that is not a regular file or is
            larger than :data:`MAX_TEXT_BYTES`, an unreadable or non-UTF-8 file, no
            window of at least 2 tokens, or bad sizes.
    """
    from tqdm import tqdm

    _check_sizes(num_samples, max_seq_length)
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    if not files:
        raise CalibrationError(
            "calibration data: no text file given; expected at least one. Fix: pass "
            "--text FILE (repeatable) or --dataset NAME."
        )
    for file in files:
        check_text_file(file)
    samples: list[torch.Tensor] = []
    for file in tqdm(files, desc="tokenizing", unit="file", file=sys.stderr, disable=not progress):
        text = _read_text_file(file)
        ids = tokenizer(text, return_tensors="pt")["input_ids"].long().reshape(-1)
        for start in range(0, ids.numel(), max_seq_length):
            piece = ids[start : start + max_seq_length]
            if piece.numel() >= 2:
                samples.append(piece.view(1, -1))
        if num_samples is not None and len(samples) >= num_samples:
            samples = samples[:num_samples]
            break
    if not samples:
        raise CalibrationError(
            f"calibration data: {', '.join(map(str, files))} give no sample of at least 2 "
            "tokens; expected real text. Fix: pass longer text files."
        )
    names = ", ".join(str(f) for f in files)
    return CalibrationData(tuple(samples), f"text files {names}", max_seq_length)


def _open_dataset(name: str, config: str | None, split: str) -> Any:
    path = Path(name)
    if os.path.lexists(path):
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = 0
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            raise CalibrationError(
                f"calibration data: --dataset {name} is neither a regular file nor a folder (a "
                "FIFO, a device or a broken link); kvquant reads local datasets from files and "
                "folders only. Fix: save the data to a .jsonl/.json/.csv/.parquet file, or pass "
                "a dataset name."
            )
    try:
        import datasets
    except ImportError as exc:
        raise CalibrationError(
            f"calibration data: --dataset {name} needs the datasets library, which is not "
            "installed. Fix: pip install datasets (kvquant's 'calibrate' extra), or pass "
            "--text FILE instead."
        ) from exc
    try:
        if path.is_dir() and (path / "dataset_info.json").is_file():
            loaded = datasets.load_from_disk(str(path))
            return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
        suffix = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
        if path.is_file() and path.suffix in suffix:
            return datasets.load_dataset(suffix[path.suffix], data_files=str(path), split=split)
        return datasets.load_dataset(name, config, split=split)
    except (OSError, ValueError, KeyError, FileNotFoundError) as exc:
        raise CalibrationError(
            f"calibration data: the datasets library could not load {name!r} (config "
            f"{config!r}, split {split!r}): {type(exc).__name__}: {exc}. Fix: check the name, "
            "--dataset-config and --split (e.g. --dataset wikitext --dataset-config "
            "wikitext-2-raw-v1 --split train), or pass --text FILE."
        ) from exc


def load_dataset_samples(
    name: str,
    tokenizer: Any,
    *,
    config: str | None = None,
    split: str = "train",
    text_column: str = "text",
    num_samples: int = 512,
    max_seq_length: int = 2048,
    progress: bool = False,
    dataset: Any = None,
) -> CalibrationData:
    """Calibration samples from a dataset of the ``datasets`` library (like llm-compressor's).

    The first ``num_samples`` rows whose text has at least 2 tokens are kept,
    each truncated to ``max_seq_length`` tokens: one sample per row.

    Args:
        name: a dataset on the Hugging Face hub (``"wikitext"``), a folder
            written by ``Dataset.save_to_disk``, or a local ``.json``/``.jsonl``/
            ``.csv``/``.parquet`` file.
        tokenizer: the model's tokenizer.
        config: the dataset configuration (``"wikitext-2-raw-v1"``).
        split: the split to read.
        text_column: the column holding the text.
        num_samples: rows to keep.
        max_seq_length: tokens per sample at most.
        progress: show a tqdm bar on stderr.
        dataset: an already loaded dataset (any sequence of mappings) to read
            instead of loading ``name``; ``name`` then only describes it.

    Returns:
        The :class:`CalibrationData`.

    Raises:
        CalibrationError: ``datasets`` not installed, the dataset cannot be
            loaded, no such column, too few usable rows, or bad sizes.
    """
    from tqdm import tqdm

    _check_sizes(num_samples, max_seq_length)
    rows = dataset if dataset is not None else _open_dataset(name, config, split)
    columns = list(getattr(rows, "column_names", None) or [])
    if columns and text_column not in columns:
        raise CalibrationError(
            f"calibration data: dataset {name!r} has no column {text_column!r}; its columns "
            f"are {columns}. Fix: pass --text-column with one of them."
        )
    samples: list[torch.Tensor] = []
    bar = tqdm(
        total=num_samples, desc="tokenizing", unit="sample", file=sys.stderr, disable=not progress
    )
    with bar:
        for row in rows:
            text = row.get(text_column) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise CalibrationError(
                    f"calibration data: a row of dataset {name!r} has no text in column "
                    f"{text_column!r} (got {type(text).__name__}). Fix: pass --text-column "
                    "naming a text column."
                )
            if not text.strip():
                continue
            ids = tokenizer(text, return_tensors="pt")["input_ids"].long().reshape(-1)
            ids = ids[:max_seq_length]
            if ids.numel() < 2:
                continue
            samples.append(ids.view(1, -1))
            bar.update(1)
            if len(samples) == num_samples:
                break
    if not samples:
        raise CalibrationError(
            f"calibration data: dataset {name!r} (split {split!r}, column {text_column!r}) has "
            "no row with at least 2 tokens of text. Fix: pick another split or column."
        )
    where = name + (f" ({config})" if config else "")
    source = f"dataset {where}, split {split}, column {text_column}"
    return CalibrationData(tuple(samples), source, max_seq_length)


# ---------------------------------------------------------------------------
# writing a checkpoint


def _layer_homes(files: Sequence[Path], num_layers: int) -> tuple[str, dict[int, str]]:
    """Tensor-name prefix of the decoder layers and, per layer, the shard holding its attention."""
    from safetensors import safe_open

    pattern = re.compile(r"^(.*?)layers\.(\d+)\.self_attn\.")
    prefix: str | None = None
    homes: dict[int, str] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                m = pattern.match(name)
                if m is None:
                    continue
                prefix = m.group(1) if prefix is None else prefix
                homes.setdefault(int(m.group(2)), str(file))
    if prefix is None or sorted(homes) != list(range(num_layers)):
        raise CalibrationError(
            f"write_calibrated_checkpoint: found attention weights of layers {sorted(homes)[:8]} "
            f"in {[str(f) for f in files][:3]}; expected 'layers.N.self_attn.*' tensors for "
            f"all {num_layers} layers. Fix: pass the checkpoint the model was loaded from."
        )
    return prefix, homes


def write_calibrated_checkpoint(
    src_dir: str | Path,
    result: CalibrationResult,
    out_dir: str | Path,
    convention: str = "compressed-tensors",
    *,
    force: bool = False,
    link: bool = False,
    progress: bool = False,
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
    extra_files: Mapping[str, FileContent] | None = None,
) -> Path:
    """Write a copy of ``src_dir`` carrying ``result``'s scales in a producer's convention.

    * ``compressed-tensors``: ``self_attn.k_scale`` / ``v_scale``, fp32 ``(1,)``
      (``strategy: tensor``) or ``(Hkv, 1, 1)`` (per-head, ``strategy: attn_head``),
      KV-only ``quantization_config`` with ``kv_cache_scheme``;
    * ``modelopt``: ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale``, fp32 ``()``,
      ``hf_quant_config.json`` with ``kv_cache_quant_algo: FP8``;
    * ``quark``: ``self_attn.k_proj.output_scale`` / ``v_proj.output_scale``, fp32
      ``()``, ``kv_cache_post_rope: true`` (separate post-RoPE K and V);
    * ``kvquant`` (k-transform results only): ``self_attn.k_scale`` / ``v_scale``
      fp32 ``(Hkv,)`` and ``self_attn.k_offset`` fp32 ``(Hkv, head_dim)`` (rotated
      frame), ``kvquant_kv_transform.json`` (format, version, rotation,
      first_tokens, geometry) and no ``quantization_config``; only kvquant reads it.

    Every file is copied (configs and tokenizer always; weight shards unless
    ``link``); the shard(s) receiving scales are re-saved with every other tensor
    unchanged; KV scales already in the source are replaced. The config records
    how the scales were chosen (compressed-tensors ``observer``: ``"mse"`` after
    a clipping search, ``"minmax"`` for ``amax / 448``; Quark's ``observer_cls``
    likewise), and ``kvquant-calibration.json`` what was calibrated on, how, the
    per-layer report and the format written. The copy is written into a
    temporary folder with :mod:`kvquant.checkpoint.writer` (the writer
    ``kvquant export`` uses), re-discovered and checked, then renamed into place:
    a failed write leaves nothing at ``out_dir``.

    Args:
        src_dir: the checkpoint folder the model was loaded from.
        result: scales from :func:`calibrate`.
        out_dir: the output folder; must not exist unless ``force``.
        convention: ``"compressed-tensors"`` (per-tensor or per-head),
            ``"modelopt"`` or ``"quark"`` (per-tensor only), ``"kvquant"`` (k-transform).
        force: replace ``out_dir`` if it is an existing folder.
        link: hard-link the unchanged weight shards instead of copying them
            (saves disk space; the output then shares those files with the source).
        progress: show a tqdm progress bar (bytes written) on stderr.
        extra_tensors: more tensors to store, by name (e.g. per-layer tensors of a
            format beyond the K/V scales); a name with ``layers.N.`` goes into the
            shard holding layer ``N``'s attention, any other into layer 0's. A
            name the checkpoint already holds is an error.
        extra_files: more files to write into the copy, by file name: a
            JSON-ready dict (strict JSON), text or bytes.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        CheckpointError: ``src_dir`` is not a readable checkpoint.
        CalibrationError: unknown convention, per-head with a per-tensor-only
            convention, geometry mismatch, or quantized weights of another producer.
        ExportTargetExistsError: ``out_dir`` exists and ``force`` is False.
        ExportError: the written copy failed its own check (nothing is left behind).
    """
    from kvquant import export as _export
    from kvquant.checkpoint.discovery import discover_scales

    if convention not in CONVENTIONS:
        raise CalibrationError(
            f"write_calibrated_checkpoint: convention {convention!r}; expected one of "
            f"{CONVENTIONS}. Fix: pass one of those names."
        )
    if (result.granularity == K_TRANSFORM) != (convention == "kvquant"):
        raise CalibrationError(
            f"write_calibrated_checkpoint: a {result.granularity} result in the {convention} "
            "convention; the k-transform is stored only in kvquant's own convention (k_offset "
            "tensors and kvquant_kv_transform.json; no serving engine reads it) and kvquant's "
            "convention holds only the k-transform. Fix: pass convention='kvquant' for a "
            "k-transform result, a producer convention for per-tensor or per-head scales."
        )
    if result.granularity == "per-head" and convention != "compressed-tensors":
        raise CalibrationError(
            f"write_calibrated_checkpoint: per-head scales cannot be stored in the {convention} "
            "convention (its config has no per-head KV strategy). Fix: use "
            "convention='compressed-tensors' (strategy attn_head) or calibrate per-tensor."
        )
    found = discover_scales(src_dir)
    src = found.path
    out = Path(out_dir)
    geometry = found.geometry
    if geometry.num_layers != result.num_layers or geometry.num_kv_heads != result.num_kv_heads:
        raise CalibrationError(
            f"write_calibrated_checkpoint: {src} has {geometry.num_layers} layers x "
            f"{geometry.num_kv_heads} KV heads but the scales are for {result.num_layers} x "
            f"{result.num_kv_heads}. Fix: calibrate the model loaded from {src}."
        )
    weights = _export._weight_quantization(found)
    if weights is not None and found.producer != convention:
        raise CalibrationError(
            f"write_calibrated_checkpoint: {src} has quantized weights ({weights}, producer "
            f"{found.producer}); writing {convention} KV scales would mix conventions. Fix: pass "
            f"convention={found.producer!r} if kvquant writes it, or calibrate the unquantized "
            "checkpoint."
        )
    if found.k_transform is not None:
        raise CalibrationError(
            f"write_calibrated_checkpoint: {src} already carries a k-transform (k_offset "
            "tensors and kvquant_kv_transform.json); expected a checkpoint without one. Fix: "
            "calibrate the original checkpoint it was calibrated from."
        )
    check_output_path(src, out, force)
    prefix, homes = _layer_homes(found.files, result.num_layers)

    if convention == "kvquant":
        shape: tuple[int, ...] = (result.num_kv_heads,)
    else:
        shape = producers.stored_scale_shape(convention, result.granularity, result.num_kv_heads)
    named = kv_scale_tensors(
        # kvquant's own convention names its scales as compressed-tensors does
        "compressed-tensors" if convention == "kvquant" else convention,
        {i: result.layer_scales(i) for i in range(result.num_layers)},
        shape,
        prefix=prefix,
    )
    new_tensors: dict[str, torch.Tensor] = {}
    tensor_homes: dict[str, Path] = {}
    layers: list[Any] = []
    for i, ((k_name, kt), (v_name, vt)) in named.items():
        new_tensors[k_name], new_tensors[v_name] = kt, vt
        tensor_homes[k_name] = tensor_homes[v_name] = Path(homes[i])
        if result.k_offset is not None:
            o_name = producers.k_offset_tensor_name(i, prefix=prefix)
            new_tensors[o_name] = result.k_offset[i].float().contiguous().clone()
            tensor_homes[o_name] = Path(homes[i])
        layers.append(
            _export.LayerExport(
                layer=i,
                k_name=k_name,
                v_name=v_name,
                shape=shape,
                k=tuple(float(x) for x in kt.reshape(-1)),
                v=tuple(float(x) for x in vt.reshape(-1)),
            )
        )
    for name, tensor in (extra_tensors or {}).items():
        if name in new_tensors:
            raise CalibrationError(
                f"write_calibrated_checkpoint: extra tensor {name!r} has the name of a KV scale "
                "being written. Fix: give it another name."
            )
        layer = re.search(r"layers\.(\d+)\.", name)
        index = int(layer.group(1)) if layer is not None else 0
        if index not in homes:
            raise CalibrationError(
                f"write_calibrated_checkpoint: extra tensor {name!r} names layer {index}; the "
                f"checkpoint has layers 0..{result.num_layers - 1}. Fix: name an existing layer."
            )
        new_tensors[name] = tensor
        tensor_homes[name] = Path(homes[index])

    transform_files: dict[str, FileContent] = {}
    qcfg: dict[str, Any] | None = None
    hf_quant: dict[str, Any] | None = None
    if convention == "kvquant":
        # declared by kvquant_kv_transform.json alone: config.json loses any KV scheme
        if weights is not None:
            raise CalibrationError(
                f"write_calibrated_checkpoint: {src} has quantized weights ({weights}); the "
                "k-transform is written beside unquantized weights only. Fix: calibrate the "
                "unquantized checkpoint."
            )
        import dataclasses

        config = json.loads(json.dumps(found.config))
        for holder in (config, config.get("text_config")):
            if isinstance(holder, dict):
                holder.pop("quantization_config", None)
        found = dataclasses.replace(found, config=config)
        if result.k_offset is None:
            raise CalibrationError(
                "write_calibrated_checkpoint: a k-transform result without offsets. "
                "Fix: calibrate with granularity='k-transform'."
            )
        settings = producers.kv_transform_config(
            rotation=result.rotation,
            first_tokens=result.first_tokens,
            head_dim=int(result.k_offset.shape[-1]),
            num_kv_heads=result.num_kv_heads,
            num_layers=result.num_layers,
        )
        transform_files[producers.KV_TRANSFORM_FILE] = json.dumps(settings, indent=2) + "\n"
    elif convention == "quark":
        # KV-only, calibrated after RoPE: separate K and V, nothing else quantized.
        quark = producers.quark_config(post_rope=True)
        if result.observer == "mse":
            for group in ("layer_quant_config", "kv_cache_quant_config"):
                for entry in quark[group].values():
                    entry["output_tensors"]["observer_cls"] = "PerTensorMSEObserver"
        qcfg = quark
    else:
        qcfg, hf_quant = _export._new_configs(
            convention, result.granularity, found, weights, observer=result.observer
        )
        if convention == "modelopt" and qcfg is None and weights is None:
            qcfg = producers.modelopt_quantization_config(
                (hf_quant or {}).get("producer", {"name": "modelopt"}), ignore=()
            )
    notes = [
        f"scales calibrated by kvquant on {result.num_samples} samples, {result.num_tokens} "
        f"tokens ({result.granularity}; {result.method})"
    ]
    if found.scales:
        notes.append(f"{len(found.scales)} KV-scale tensors of the source were replaced")
    report = _export.ExportReport(
        source=str(src),
        out=str(out),
        engine="kvquant",
        granularity=result.granularity,
        source_producer=found.producer,
        target_convention=convention,
        layers=tuple(layers),
        notes=tuple(notes),
    )
    from kvquant import __version__

    metadata = {
        "calibrated_by": f"kvquant {__version__}",
        "source": str(src),
        "convention": convention,
        "format": result.granularity,
        **result.to_dict(),
    }
    files: dict[str, FileContent] = {_REPORT_FILE: metadata, **transform_files}
    for name, content in (extra_files or {}).items():
        if name in files:
            raise CalibrationError(
                f"write_calibrated_checkpoint: extra file {name!r} is the name of a file kvquant "
                f"writes there (the calibration report or the k-transform settings: "
                f"{', '.join(sorted(files))}). Fix: give it another name."
            )
        files[name] = content
    edit = CheckpointEdit(
        tensors=new_tensors,
        homes=tensor_homes,
        drop=[raw.name for raw in found.scales],
        quantization_config=qcfg,
        hf_quant_config=hf_quant,
        files=files,
        # an export report of the source describes other scales than the copy's
        skip=(_export.REPORT_FILE,),
    )
    _export.write_report_copy(
        found, out, edit, report, force=force, link=link, progress=progress, report_file=None
    )
    return out

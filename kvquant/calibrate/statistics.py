"""Bounded running statistics of the post-RoPE K and V that calibration chooses scales from.

:class:`KVStatistics` keeps, per layer, KV head and kind, the amax and a
fixed-size histogram of ``|x|`` in logarithmic bins (optionally a second one
weighted by :func:`attention_weights`); :class:`ChannelStatistics` keeps per-channel
K sums and ranges for the k-transform and the report. Memory is fixed by the
model's geometry, never by the text length. How they are collected:
docs/dev/calibration.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvquant.calibrate.fp8 import FP8_E4M3_MAX, hadamard_matrix
from kvquant.calibrate.options import CENTRES, Centre, parse_choice
from kvquant.errors import CalibrationError

__all__ = [
    "BINS_PER_OCTAVE",
    "LOG2_MAX",
    "LOG2_MIN",
    "NEAR_CONSTANT_RATIO",
    "ChannelStatistics",
    "KVStatistics",
    "attention_weights",
    "bin_centres",
    "near_constant_share",
    "num_bins",
]

BINS_PER_OCTAVE = 64
"""Histogram bins per power of two (bin width ~1.1 % of the value; the e4m3 grid step is 6-12 %)."""

LOG2_MIN = -24
"""Values below ``2**LOG2_MIN`` (and zeros) fall into bin 0, counted as exact zeros."""

LOG2_MAX = 20
"""Values above ``2**LOG2_MAX`` fall into the last bin (their amax is still exact)."""

NEAR_CONSTANT_RATIO = 0.25
"""A K channel is near-constant when its token-to-token std is below this times ``|mean|``."""


def num_bins() -> int:
    """Histogram bins from ``2**LOG2_MIN`` to ``2**LOG2_MAX``."""
    return (LOG2_MAX - LOG2_MIN) * BINS_PER_OCTAVE


def bin_centres() -> torch.Tensor:
    """Representative value of every histogram bin.

    Returns:
        fp64 [num_bins]: 0 for bin 0 (zeros and values below ``2**LOG2_MIN``),
        else the geometric centre of the bin.
    """
    i = torch.arange(num_bins(), dtype=torch.float64)
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
        """fp64 [L, H]: :func:`near_constant_share`, first tokens out."""
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
        chosen = parse_choice(Centre, centre)
        if chosen is None:
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
        if chosen is Centre.MEAN:
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
        self.k_hist = torch.zeros((*shape, num_bins()), dtype=torch.float64)
        self.v_hist = torch.zeros((*shape, num_bins()), dtype=torch.float64)
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
            idx = idx.clamp(0, num_bins() - 1).long()
            if bad:
                # non-finite entries were zeroed: take them out of bin 0 again
                idx = torch.where(finite, idx, torch.full_like(idx, -1))
            offset = torch.arange(self.num_kv_heads, device=idx.device)[:, None] * num_bins()
            keep = idx >= 0
            flat = (idx + offset)[keep]
            size = self.num_kv_heads * num_bins()
            counts = torch.bincount(flat, minlength=size)
            hist[layer] += counts.view(self.num_kv_heads, -1).to("cpu", torch.float64)
            if whist is not None and weight is not None:
                w = weight.detach().double().transpose(0, 1).reshape(self.num_kv_heads, -1)
                wsum = torch.bincount(flat, weights=w[keep], minlength=size)
                whist[layer] += wsum.view(self.num_kv_heads, -1).to("cpu", torch.float64)
        if self.channels is not None:
            self.channels.update(layer, key)
        self.updates[layer] += 1

    def observe(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> None:
        """Add what one attention call saw (the collection's hook; weights when ``weighted``)."""
        if self.weighted:
            wk, wv = attention_weights(query, key, scaling)
            self.update(layer, key, value, wk, wv)
        else:
            self.update(layer, key, value)


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


def near_constant_share(
    count: torch.Tensor, total: torch.Tensor, total_sq: torch.Tensor
) -> torch.Tensor:
    """Share of K energy in near-constant channels.

    Per channel, mean ``m`` and standard deviation ``sd`` over the tokens; a channel
    is near-constant when ``sd < NEAR_CONSTANT_RATIO * |m|``; the share is those
    channels' ``sum_t k**2`` over every channel's.

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

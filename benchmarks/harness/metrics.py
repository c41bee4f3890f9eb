"""Distribution metrics of an FP8 KV run against the unquantized model, with bootstrap errors.

Test and benchmark harness, not part of the kvquant package.

Every scored position compares the run's next-token distribution with the
unquantized model's on the same tokens:

* **KL divergence** ``KL(p_ref || p_run)`` (nats), its mean and 99th percentile;
* **top-1 agreement**: the run's argmax equals the reference's argmax;
* **perplexity change** ``100 * (exp(mean NLL_run - mean NLL_ref) - 1)`` percent.

Standard errors come from a block bootstrap: the positions of each window are cut
into consecutive blocks (64 by default, so nearby, correlated positions move
together), and blocks are resampled with replacement *within each text*, so every
resample keeps the texts' mix. The same resampled blocks are used for every run,
so the difference of two runs gets a paired standard error.

Only the decoder's last hidden states are kept per run (``[N, hidden]``); the
output head is applied chunk by chunk when two runs are compared, so the full
``[N, vocab]`` matrix never exists at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvquant.errors import OptionError

__all__ = [
    "METRICS",
    "BlockLayout",
    "PositionStats",
    "RunMetrics",
    "TextMetrics",
    "bootstrap_draws",
    "compare_hidden",
    "compare_logits",
    "decoder_hidden",
    "metric_draws",
    "spread",
    "summarize",
]

METRICS = ("kl_mean", "top1", "ppl_delta_pct")
"""Metrics with a bootstrap standard error (the 99th percentile of KL has none)."""


@dataclass(frozen=True)
class PositionStats:
    """Per-position comparison of one run with the reference, window after window.

    Attributes:
        kl: fp64 [N], ``KL(p_ref || p_run)`` in nats.
        nll: fp64 [N], the run's negative log-likelihood of the next token.
        ref_nll: fp64 [N], the reference's.
        agree: bool [N], the run's argmax equals the reference's.
    """

    kl: torch.Tensor
    nll: torch.Tensor
    ref_nll: torch.Tensor
    agree: torch.Tensor


def compare_logits(
    ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor
) -> PositionStats:
    """Compare two runs' logits position by position.

    Args:
        ref_logits: [N, V] logits of the unquantized model.
        logits: [N, V] logits of the run under test, same positions.
        targets: int64 [N], the actual next tokens.

    Returns:
        :class:`PositionStats` over the N positions (computed in fp64).

    Raises:
        KVQuantError: shapes disagree.
    """
    if ref_logits.shape != logits.shape or ref_logits.dim() != 2:
        raise OptionError(
            f"compare_logits: logits {tuple(logits.shape)} vs reference "
            f"{tuple(ref_logits.shape)}; expected two [N, vocab] tensors of the same shape. "
            "Fix: score the same positions in both runs."
        )
    if targets.shape != (ref_logits.shape[0],):
        raise OptionError(
            f"compare_logits: targets {tuple(targets.shape)}; expected [{ref_logits.shape[0]}] "
            "(one next token per position). Fix: pass input_ids[:, 1:].flatten()."
        )
    ref_logp = torch.log_softmax(ref_logits.double(), dim=-1)
    logp = torch.log_softmax(logits.double(), dim=-1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1).clamp_min(0.0)
    idx = targets.view(-1, 1).to(logits.device)
    return PositionStats(
        kl=kl.cpu(),
        nll=-logp.gather(-1, idx)[:, 0].cpu(),
        ref_nll=-ref_logp.gather(-1, idx)[:, 0].cpu(),
        agree=(logits.argmax(dim=-1) == ref_logits.argmax(dim=-1)).cpu(),
    )


@torch.no_grad()
def decoder_hidden(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Last hidden states of every position that predicts a next token.

    One forward with ``use_cache=False`` (run it inside
    :func:`benchmarks.harness.accuracy.simulate_fp8_kv` to round K/V).

    Args:
        model: a transformers causal LM with ``.model`` (decoder) and ``.lm_head``.
        input_ids: int64 [B, T], T >= 2, windows of equal length.

    Returns:
        [B * (T - 1), hidden] on the model's device, window after window.
    """
    decoder: Any = getattr(model, "model", None)
    if decoder is None or getattr(model, "lm_head", None) is None:
        raise OptionError(
            f"decoder_hidden: {type(model).__name__} has no `.model` / `.lm_head`; expected a "
            "*ForCausalLM model. Fix: pass the causal-LM wrapper, not the bare decoder."
        )
    ids = input_ids.to(next(model.parameters()).device)
    hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
    return hidden[:, :-1].flatten(0, 1)


@torch.no_grad()
def compare_hidden(
    model: torch.nn.Module,
    ref_hidden: torch.Tensor,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    chunk: int = 1024,
) -> PositionStats:
    """Apply the output head to two runs' hidden states in chunks and compare them.

    Args:
        model: the causal LM whose ``lm_head`` (and final logit softcapping) applies.
        ref_hidden: [N, hidden] from :func:`decoder_hidden` of the reference run.
        hidden: [N, hidden] of the run under test.
        input_ids: int64 [B, T] the runs scored (N = B * (T - 1)).
        chunk: positions per head call.

    Returns:
        :class:`PositionStats` over the N positions.
    """
    head: Any = model.lm_head  # type: ignore[attr-defined]
    targets = input_ids[:, 1:].flatten()
    if ref_hidden.shape != hidden.shape or hidden.shape[0] != targets.shape[0]:
        raise OptionError(
            f"compare_hidden: hidden {tuple(hidden.shape)} vs reference "
            f"{tuple(ref_hidden.shape)} for {targets.shape[0]} scored positions; expected "
            "equal shapes with one row per position. Fix: run both on the same input_ids."
        )
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    parts = []
    for start in range(0, hidden.shape[0], chunk):
        pair = []
        for h in (ref_hidden, hidden):
            logits = head(h[start : start + chunk]).float()
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            pair.append(logits)
        parts.append(compare_logits(pair[0], pair[1], targets[start : start + chunk]))
    return PositionStats(
        kl=torch.cat([p.kl for p in parts]),
        nll=torch.cat([p.nll for p in parts]),
        ref_nll=torch.cat([p.ref_nll for p in parts]),
        agree=torch.cat([p.agree for p in parts]),
    )


@dataclass(frozen=True)
class BlockLayout:
    """How scored positions are cut into bootstrap blocks.

    Attributes:
        window_texts: the text each window comes from, in window order.
        positions_per_window: scored positions per window (T - 1).
        block: positions per block (the last block of a window may be shorter).
    """

    window_texts: tuple[str, ...]
    positions_per_window: int
    block: int = 64

    def __post_init__(self) -> None:
        if self.block <= 0 or self.positions_per_window <= 0 or not self.window_texts:
            raise OptionError(
                f"BlockLayout: block={self.block}, positions_per_window="
                f"{self.positions_per_window}, {len(self.window_texts)} windows; expected "
                "positive sizes and at least one window. Fix: pass the evaluation layout."
            )

    @property
    def texts(self) -> tuple[str, ...]:
        """Distinct texts, in first-appearance order."""
        return tuple(dict.fromkeys(self.window_texts))

    @property
    def num_positions(self) -> int:
        """Scored positions over all windows."""
        return len(self.window_texts) * self.positions_per_window

    def block_ids(self) -> torch.Tensor:
        """int64 [N]: the block of every position (blocks never straddle windows)."""
        per_window = math.ceil(self.positions_per_window / self.block)
        local = torch.arange(self.positions_per_window) // self.block
        return torch.cat([local + w * per_window for w in range(len(self.window_texts))])

    def block_texts(self) -> list[str]:
        """The text of every block, in block order."""
        per_window = math.ceil(self.positions_per_window / self.block)
        return [t for t in self.window_texts for _ in range(per_window)]

    def text_mask(self, text: str) -> torch.Tensor:
        """bool [N]: positions of ``text``."""
        return torch.tensor(
            [t == text for t in self.window_texts for _ in range(self.positions_per_window)]
        )


def bootstrap_draws(layout: BlockLayout, resamples: int, seed: int = 0) -> torch.Tensor:
    """Block indices of every bootstrap resample, drawn within each text.

    Args:
        layout: the block layout.
        resamples: number of resamples R.
        seed: generator seed (same seed, same draws: runs are paired).

    Returns:
        int64 [R, number of blocks]: each text's block slots refilled with that
        text's blocks drawn with replacement.
    """
    if resamples < 2:
        raise OptionError(
            f"bootstrap_draws: resamples={resamples}; expected at least 2 for a standard "
            "error. Fix: pass e.g. 1000."
        )
    texts = layout.block_texts()
    g = torch.Generator().manual_seed(seed)
    draws = torch.empty(resamples, len(texts), dtype=torch.long)
    for name in layout.texts:
        slots = torch.tensor([i for i, t in enumerate(texts) if t == name])
        pick = torch.randint(0, slots.numel(), (resamples, slots.numel()), generator=g)
        draws[:, slots] = slots[pick]
    return draws


def _block_sums(stats: PositionStats, layout: BlockLayout) -> dict[str, torch.Tensor]:
    if stats.kl.shape[0] != layout.num_positions:
        raise OptionError(
            f"metrics: {stats.kl.shape[0]} scored positions but the layout has "
            f"{layout.num_positions} ({len(layout.window_texts)} windows x "
            f"{layout.positions_per_window}); expected them equal. Fix: build the layout "
            "from the evaluated input_ids."
        )
    ids = layout.block_ids()
    n = int(ids.max()) + 1

    def total(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float64).index_add_(0, ids, x.double())

    return {
        "count": total(torch.ones_like(stats.kl)),
        "kl": total(stats.kl),
        "agree": total(stats.agree.double()),
        "dnll": total(stats.nll - stats.ref_nll),
    }


def _from_sums(count: torch.Tensor, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        "kl_mean": sums["kl"] / count,
        "top1": sums["agree"] / count,
        "ppl_delta_pct": 100.0 * torch.expm1(sums["dnll"] / count),
    }


def metric_draws(
    stats: PositionStats, layout: BlockLayout, draws: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Every metric of :data:`METRICS` on every bootstrap resample.

    Args:
        stats: one run.
        layout: its block layout.
        draws: from :func:`bootstrap_draws` (reuse them to pair runs).

    Returns:
        metric name -> fp64 [R].
    """
    sums = _block_sums(stats, layout)
    picked = {k: v[draws].sum(dim=1) for k, v in sums.items()}
    return _from_sums(picked["count"], picked)


@dataclass(frozen=True)
class TextMetrics:
    """Metrics over a set of positions (one text, or all pooled).

    Attributes:
        positions: scored positions.
        kl_mean: mean KL divergence to the reference (nats).
        kl_p99: its 99th percentile over positions.
        top1: top-1 agreement (fraction).
        ppl_delta_pct: perplexity change vs the reference (percent).
        se: block-bootstrap standard error of each metric in :data:`METRICS`.
    """

    positions: int
    kl_mean: float
    kl_p99: float
    top1: float
    ppl_delta_pct: float
    se: dict[str, float]


@dataclass(frozen=True)
class RunMetrics:
    """One run's pooled and per-text metrics.

    Attributes:
        pooled: over every scored position.
        per_text: text name -> metrics on that text's positions.
    """

    pooled: TextMetrics
    per_text: dict[str, TextMetrics]


def _text_metrics(
    stats: PositionStats, mask: torch.Tensor, boot: dict[str, torch.Tensor]
) -> TextMetrics:
    kl = stats.kl[mask]
    dnll = float((stats.nll[mask] - stats.ref_nll[mask]).mean())
    return TextMetrics(
        positions=int(mask.sum()),
        kl_mean=float(kl.mean()),
        kl_p99=float(torch.quantile(kl, 0.99)),
        top1=float(stats.agree[mask].double().mean()),
        ppl_delta_pct=100.0 * math.expm1(dnll),
        se={k: float(v.std()) for k, v in boot.items()},
    )


def summarize(
    stats: PositionStats,
    layout: BlockLayout,
    *,
    resamples: int = 1000,
    seed: int = 0,
) -> RunMetrics:
    """Pooled and per-text metrics of one run, with block-bootstrap standard errors.

    Args:
        stats: one run against the reference.
        layout: which text and window each position belongs to.
        resamples: bootstrap resamples.
        seed: bootstrap seed (per-text errors use ``seed + 1 + text index``).

    Returns:
        :class:`RunMetrics`.
    """
    pooled_boot = metric_draws(stats, layout, bootstrap_draws(layout, resamples, seed))
    pooled = _text_metrics(stats, torch.ones_like(stats.agree), pooled_boot)
    per_text = {}
    for i, name in enumerate(layout.texts):
        sub = [t for t in layout.window_texts if t == name]
        sub_layout = BlockLayout(tuple(sub), layout.positions_per_window, layout.block)
        mask = layout.text_mask(name)
        sub_stats = PositionStats(
            kl=stats.kl[mask],
            nll=stats.nll[mask],
            ref_nll=stats.ref_nll[mask],
            agree=stats.agree[mask],
        )
        boot = metric_draws(
            sub_stats, sub_layout, bootstrap_draws(sub_layout, resamples, seed + 1 + i)
        )
        per_text[name] = _text_metrics(sub_stats, torch.ones_like(sub_stats.agree), boot)
    return RunMetrics(pooled=pooled, per_text=per_text)


def spread(values: Sequence[float]) -> dict[str, float]:
    """``min``, ``max``, ``range`` and sample ``sd`` of a metric over a family of runs."""
    t = torch.tensor(list(values), dtype=torch.float64)
    if t.numel() < 2:
        raise OptionError(
            f"spread: {t.numel()} values; expected at least 2 runs. Fix: pass the whole "
            "jitter family."
        )
    return {
        "min": float(t.min()),
        "max": float(t.max()),
        "range": float(t.max() - t.min()),
        "sd": float(t.std()),
    }

"""``calibrate()``: hold out windows, collect statistics, choose the scales, measure every format.

The one call behind ``kvquant calibrate``: :func:`~kvquant.calibrate.collection.collect_statistics`
on all but the last windows, :func:`~kvquant.calibrate.search.choose_scales` or
:func:`~kvquant.calibrate.k_transform.choose_k_transform`, then
:func:`~kvquant.calibrate.evaluate.evaluate_formats` on the held-out windows and, for a byte
budget, :func:`~kvquant.calibrate.layer_map.propose_from_report`'s per-layer format map.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kvquant.calibrate.collection import collect_statistics, token_windows
from kvquant.calibrate.evaluate import evaluate_formats
from kvquant.calibrate.k_transform import choose_k_transform
from kvquant.calibrate.layer_map import check_budget, lowest_budget, propose_from_report
from kvquant.calibrate.options import (
    FORMATS,
    Centre,
    Granularity,
    Objective,
    Rotation,
    is_rotation,
    parse_choice,
)
from kvquant.calibrate.result import CalibrationResult
from kvquant.calibrate.search import DEFAULT_RATIOS, choose_scales
from kvquant.calibrate.statistics import KVStatistics
from kvquant.errors import CalibrationError

__all__ = ["calibrate", "check_kv_budget"]


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
    granularity: Granularity | str = "per-tensor",
    tokenizer: Any = None,
    window: int = 2048,
    max_tokens: int | None = None,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    tolerance: float = 0.0,
    objective: Objective | str = "mse",
    progress: bool = True,
    text_names: Sequence[str] = (),
    rotation: Rotation | str | None = "hadamard",
    first_tokens: int = 1,
    centre: Centre | str = "mean",
    held_out_tokens: int = 512,
    kv_budget: float | None = None,
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
        kv_budget: also measure the 4-bit formats (held out) and propose a per-layer map taking
            at most this share, in (0, 1], of FP8's KV bytes (``layer_map``); None: no map.

    Returns:
        A :class:`CalibrationResult` (scales per layer, canonical fp32, plus the report
        and, with ``kv_budget``, the per-layer format map).

    Raises:
        CalibrationError: bad inputs or options; a ``kv_budget`` outside (0, 1], below what
            the narrowest 4-bit format takes, or with nothing held out to measure on.
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
    chosen = _check_options(granularity, rotation, held_out_tokens, window)
    budget = _check_budget(model, kv_budget, chosen, held_out_tokens)
    windows = token_windows(model, texts_or_token_ids, tokenizer, window, max_tokens)
    windows, held_out = _split_held_out(windows, held_out_tokens)
    if budget is not None and not held_out:
        raise CalibrationError(
            f"calibrate: kv_budget={kv_budget} with {len(windows)} sample(s), none of which "
            "could be held out to measure each layer's error on. Fix: pass two or more samples "
            "(more text, or a smaller window)."
        )
    stats = collect_statistics(
        model,
        windows,
        tokenizer=tokenizer,
        window=window,
        objective=objective,
        progress=progress,
        first_tokens=first_tokens,
    )
    opts: dict[str, Any] = dict(
        ratios=ratios, tolerance=tolerance, objective=objective, texts=text_names
    )
    if chosen is Granularity.K_TRANSFORM:
        result = choose_k_transform(
            stats, rotation=rotation, first_tokens=first_tokens > 0, centre=centre, **opts
        )
    else:
        result = choose_scales(stats, chosen, **opts)
    if not held_out:
        return result
    return _with_report(model, result, held_out, stats, budget, str(chosen), progress)


def _check_budget(
    model: torch.nn.Module, kv_budget: float | None, chosen: Granularity, held_out_tokens: int
) -> float | None:
    """:func:`check_kv_budget` of a ``calibrate`` call (None: no map asked for).

    Raises:
        CalibrationError: a bad budget, or a budget with no tokens held out.
    """
    if kv_budget is None:
        return None
    budget = check_kv_budget(model, kv_budget, str(chosen))
    if held_out_tokens == 0:
        raise CalibrationError(
            f"calibrate: kv_budget={kv_budget} with held_out_tokens=0; the map is chosen by "
            "each layer's error measured on held-out tokens. Fix: hold out tokens (e.g. 512)."
        )
    return budget


def _with_report(
    model: torch.nn.Module,
    result: CalibrationResult,
    held_out: list[torch.Tensor],
    stats: KVStatistics,
    budget: float | None,
    fp8: str,
    progress: bool,
) -> CalibrationResult:
    """``result`` with the held-out report and, with a ``budget``, the per-layer format map."""
    report = evaluate_formats(
        model, result, held_out, progress=progress, four_bit=budget is not None
    )
    result = result.with_report(report)
    if budget is None or stats.channels is None:
        return result
    layer_map = propose_from_report(
        report,
        budget,
        num_kv_heads=stats.num_kv_heads,
        head_dim=stats.channels.head_dim,
        fp8=fp8,
    )
    return result.with_layer_map(layer_map)


def check_kv_budget(model: torch.nn.Module, budget: object, fp8: str = "per-tensor") -> float:
    """``budget`` as a float, refused where outside (0, 1] or below what the narrowest 4-bit
    format takes for the model (where its config names head_dim; the proposal checks again
    on what was measured), before the model runs.

    Raises:
        CalibrationError: the budget cannot be met.
    """
    value = check_budget(budget)
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None)
    if not isinstance(head_dim, int):
        hidden, heads = (
            getattr(text, "hidden_size", None),
            getattr(text, "num_attention_heads", None),
        )
        if not isinstance(hidden, int) or not isinstance(heads, int) or heads < 1:
            return value
        head_dim = hidden // heads
    if head_dim < 1:
        return value
    lowest = lowest_budget(head_dim, fp8)
    if value < lowest * (1 - 1e-12):
        raise CalibrationError(
            f"calibrate: kv_budget={value:g}, but the narrowest format for this model's head_dim "
            f"{head_dim} takes {lowest:.4f} of FP8's KV bytes in every layer; expected a budget "
            f"from {math.ceil(lowest * 1e4) / 1e4:g} to 1. Fix: pass kv_budget (--kv-budget) "
            f"{math.ceil(lowest * 1e4) / 1e4:g} or more."
        )
    return value


def _check_options(
    granularity: object, rotation: object, held_out_tokens: int, window: int
) -> Granularity:
    """The granularity :func:`calibrate` was asked for, or its refusal of the options."""
    chosen = parse_choice(Granularity, granularity)
    if chosen is None:
        raise CalibrationError(
            f"calibrate: granularity {granularity!r}; expected one of {FORMATS}. "
            "Fix: fp32-group scales are dynamic and need no calibration."
        )
    if held_out_tokens < 0:
        raise CalibrationError(
            f"calibrate: held_out_tokens={held_out_tokens}; expected >= 0. Fix: pass 0 (no "
            "report) or a token count such as 512."
        )
    if chosen is Granularity.K_TRANSFORM and not is_rotation(rotation):
        raise CalibrationError(
            f"calibrate: rotation {rotation!r}; expected 'hadamard' or None. Fix: pass one of those."
        )
    if not 2 <= window:
        raise CalibrationError(f"calibrate: window={window}; expected >= 2 tokens.")
    return chosen

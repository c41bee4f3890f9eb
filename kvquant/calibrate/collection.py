"""Collection through the model: a hook in transformers' attention that sees K/V as attention does.

:func:`observing` registers a small attention function in transformers'
``AttentionInterface`` that hands every layer's post-RoPE query, keys and values
(before the GQA repeat) to an :class:`Observer`, then runs SDPA;
:func:`collect_statistics` runs the model window by window (:func:`token_windows`)
into a :class:`~kvquant.calibrate.statistics.KVStatistics`. Transformers is
imported lazily.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from kvquant.calibrate.options import OBJECTIVES, Objective, parse_choice
from kvquant.calibrate.statistics import ChannelStatistics, KVStatistics
from kvquant.errors import CalibrationError, UnsupportedModelError

__all__ = [
    "CALIBRATION_ATTENTION",
    "Observer",
    "collect_statistics",
    "observing",
    "token_windows",
]

CALIBRATION_ATTENTION = "kvquant_calibrate"
"""Name under which the statistics-collecting attention function is registered."""

_COLLECT_ATTR = "_kvquant_calibrate"


class Observer(Protocol):
    """What :func:`observing` hands every attention call to."""

    def observe(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> None:
        """One layer's post-RoPE query [B, Hq, T, D], keys and values [B, Hkv, T, D]."""


def _observing_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """Attention function: hand K/V to the module's observer, then run transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    observer: Observer | None = getattr(module, _COLLECT_ATTR, None)
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = float(getattr(module, "scaling", query.shape[-1] ** -0.5))
    layer = int(getattr(module, "layer_idx", 0))
    if observer is not None:
        observer.observe(layer, query, key, value, float(scaling))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def observing(model: torch.nn.Module, observer: Observer) -> Iterator[None]:
    """Route every attention layer of ``model`` through ``observer`` while the block runs.

    Raises:
        CalibrationError: the model is patched by kvquant (its K/V are quantized).
        UnsupportedModelError: the model's attention does not go through transformers'
            ``AttentionInterface``.
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    from kvquant.integrations.hf.models import find_attention_sites

    if getattr(model, "_kvquant_state", None) is not None:
        raise CalibrationError(
            f"{type(model).__name__} is patched by kvquant.patch; calibration must see the "
            "unquantized K/V. Fix: call handle.remove() first, or calibrate a fresh model."
        )
    AttentionInterface.register(CALIBRATION_ATTENTION, _observing_attention)
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
            setattr(mod, _COLLECT_ATTR, observer)
        yield
    finally:
        for mod in mods:
            if hasattr(mod, _COLLECT_ATTR):
                delattr(mod, _COLLECT_ATTR)
        hf_model.set_attn_implementation(previous)


def token_windows(
    model: torch.nn.Module,
    inputs: Any,
    tokenizer: Any,
    window: int,
    max_tokens: int | None,
) -> list[torch.Tensor]:
    """Turn texts or token ids into int64 [1, <=window] windows, at most ``max_tokens`` in total.

    Raises:
        CalibrationError: texts without a tokenizer, inputs of another type, or token
            ids outside ``[0, vocab_size)``.
    """
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
    objective: Objective | str = "mse",
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

    goal = parse_choice(Objective, objective)
    if goal is None:
        raise CalibrationError(
            f"calibrate: objective {objective!r}; expected one of {OBJECTIVES}. "
            "Fix: pass 'mse' or 'attention'."
        )
    if window < 2:
        raise CalibrationError(f"calibrate: window={window}; expected >= 2 tokens.")
    if max_tokens is not None and max_tokens < 2:
        raise CalibrationError(f"calibrate: max_tokens={max_tokens}; expected >= 2 tokens.")
    geometry = _geometry(model)
    windows = token_windows(model, texts_or_token_ids, tokenizer, window, max_tokens)
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
        weighted=goal is Objective.ATTENTION,
        channels=channels,
    )
    device = next(model.parameters()).device
    decoder: Any = getattr(model, "model", model)
    total = sum(w.numel() for w in windows)
    with (
        observing(model, stats),
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


def _geometry(model: torch.nn.Module) -> Any:
    """The model's layer geometry, if kvquant can patch it and its layers agree on KV heads."""
    from kvquant.integrations.hf.models import (
        check_supported,
        find_attention_sites,
        model_geometry,
    )

    check_supported(model)  # the written checkpoint must be usable by kvquant.patch
    geometry = model_geometry(model, find_attention_sites(model))
    if geometry.layer_num_kv_heads is not None:
        raise CalibrationError(
            f"calibrate: {type(model).__name__} has layers with different KV-head counts "
            f"({geometry.describe()}); kvquant's calibration statistics hold one KV-head count "
            "for every layer. Fix: patch the model without static scales (kvquant.patch(model): "
            "the dynamic fp32-group scales serve every layer geometry)."
        )
    return geometry

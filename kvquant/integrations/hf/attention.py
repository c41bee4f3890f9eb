"""kvquant's attention function and mask function for transformers' interfaces.

Both are registered under the name ``"kvquant"`` (``AttentionInterface`` and
``AttentionMaskInterface``; without a mask function transformers builds no mask
and left-padded batches would attend to their padding). Over kvquant's
``(None, None)`` from the cache layer, the attention function reads the layer's
FP8 pages with :func:`kvquant.kernels.paged_attention`; over dense K/V (a
prompt with no cached prefix, or no kvquant cache) it hands the call to the
model's previous implementation (:func:`fallback_attention`), exactly as the
unpatched model.

Design: docs/dev/cache.md.
"""

from __future__ import annotations

import logging
import math
import sys
import weakref
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvquant.errors import UnsupportedModelError
from kvquant.integrations.hf.cache_layer import ATTN_NAME, KVQuantCache, KVQuantLayer
from kvquant.integrations.hf.continuous import BATCH_KWARG
from kvquant.integrations.hf.step_ops import STEP_KWARG, step_attention_call

__all__ = ["ATTN_NAME", "fallback_attention", "kvquant_attention", "kvquant_mask", "register"]

_MASK_CHUNK = 1 << 24
"""Mask elements whose int32 temporaries :func:`kv_start_from_mask` holds at once."""

CACHE_ATTR = "_kvq_cache"
"""Attribute of an attention module holding the cache of the current forward call."""

FALLBACK_ATTR = "_kvq_fallback_attn"
"""Attribute of an attention module: the attention implementation the model had before the patch."""

STEP_LAYER_ATTR = "_kvq_step_layer"
"""Attribute of an attention module during a compiled decode step: its cache layer.

Set by the graph runner (:mod:`kvquant.integrations.hf.graphs`) while the
decoder layers run their ``torch.compile``'d forwards, which get no cache
(so that no per-layer index enters the compiled code). The attention function
normally gets the layer's tensors as the keyword ``STEP_KWARG`` and stores the
new token's K/V through kvquant's custom ops; where a decoder layer does not
hand that keyword on, it stores them in the layer named here instead.
"""

_logger = logging.getLogger("kvquant")
_logged_breaks: set[type[nn.Module]] = set()


def _log_step_break(module: nn.Module) -> None:
    """Log once per attention class that its compiled decode step breaks the graph here."""
    cls = type(module)
    if cls in _logged_breaks:
        return
    _logged_breaks.add(cls)
    _logger.info(
        "kvquant: the compiled decode step of %s breaks its graph at kvquant's attention: its "
        "decoder layer does not pass the keyword %r on to the attention function, so the cache "
        "layer stores the new K/V outside the compiled graph (same results; the first compiled "
        "step compiles two graphs per layer instead of one).",
        cls.__name__,
        STEP_KWARG,
    )


def kvquant_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """Mask function: transformers' boolean SDPA mask ``[B, 1, Lq, T]`` (True = attend) or None."""
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register kvquant's attention and mask functions under ``"kvquant"`` (idempotent)."""
    AttentionInterface.register(ATTN_NAME, kvquant_attention)
    AttentionMaskInterface.register(ATTN_NAME, kvquant_mask)


def _layer_of(module: nn.Module) -> KVQuantLayer | None:
    cache = getattr(module, CACHE_ATTR, None)
    if isinstance(cache, KVQuantCache):
        idx = int(getattr(module, "layer_idx", -1))
        if 0 <= idx < len(cache.layers):
            layer = cache.layers[idx]
            if isinstance(layer, KVQuantLayer):
                return layer
    return None


def _name(module: nn.Module) -> str:
    """How messages name an attention module."""
    return f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__})"


def _bool_mask(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    return mask == 0  # additive float mask: 0 = attend, -inf / min = masked


def kv_start_from_mask(
    mask: torch.Tensor | None,
    seq_len: int,
    q_len: int,
    window: int,
    name: str,
    *,
    raw: bool = False,
) -> torch.Tensor | None:
    """Left-padding start ``int32 [B]`` from a boolean mask ``[B, 1, Lq, T]`` (None: no padding).

    ``kv_start[b]`` is the first key column any real query row of sequence
    ``b`` attends to; a sequence without any real query row in the call (a
    prefill chunk that is all padding for it) gets the call's first position.
    Fully masked rows (padding queries) are ignored; rows
    that an older transformers turned all-True to dodge NaNs are ignored
    unless the newest row (always a real token) sees column 0. The mask is
    then checked to be exactly "causal from ``kv_start``" (plus the sliding
    window): packed sequences or custom 4D masks are refused. ``raw=True``
    skips that check and gives a sequence without any real query ``seq_len``
    instead of 0 (its first visible token is still to come): the starts the
    first-token buffer of the ``k-transform`` format needs, also on the dense
    prompt path, which runs the model's own attention on the mask.

    Raises:
        UnsupportedModelError: the mask is not left padding + causal (+ window).
    """
    if mask is None:
        return None
    m = _bool_mask(mask)
    if m.dim() != 4 or m.shape[-1] != seq_len or m.shape[-2] != q_len:
        raise UnsupportedModelError(
            f"{name}: attention mask of shape {tuple(m.shape)}; kvquant expects [batch, 1, {q_len}, "
            f"{seq_len}] (queries x cached keys). Fix: pass a 2D padding mask, not a custom 4D mask."
        )
    m = m[:, 0]  # [B, Lq, T]; heads share the mask
    device = m.device
    cols = torch.arange(seq_len, device=device, dtype=torch.int32)
    # Rows are processed in chunks so that the temporaries stay a bounded multiple of
    # _MASK_CHUNK elements, however long the prompt chunk (the mask itself is B*Lq*T).
    step = max(1, _MASK_CHUNK // max(1, m.shape[0] * seq_len))
    last_sees_zero = m[:, -1, 0]  # [B]
    start = torch.full((m.shape[0],), seq_len, dtype=torch.int32, device=device)
    for r0 in range(0, q_len, step):
        rows = m[:, r0 : r0 + step]  # [B, r, T]
        first = torch.where(rows, cols, seq_len).amin(-1)  # [B, r]
        ignore = ~rows.any(-1) | (rows.all(-1) & ~last_sees_zero[:, None])
        start = torch.minimum(start, torch.where(ignore, seq_len, first).amin(-1))
    if raw:
        return start.to(torch.int32)
    # A sequence with no real query in this call (a chunk of a chunked prefill that is all
    # padding for it): every row is ignorable padding; it attends causally within the call's
    # own tokens only (finite, never read by a real token), so it needs no check.
    padding_only = start >= seq_len
    start = torch.where(padding_only, torch.full_like(start, seq_len - q_len), start)
    # Check: real rows must equal the reconstructed pattern.
    bad = torch.zeros((), dtype=torch.bool, device=device)
    for r0 in range(0, q_len, step):
        rows = m[:, r0 : r0 + step]
        pos_q = torch.arange(
            seq_len - q_len + r0, seq_len - q_len + r0 + rows.shape[1], device=device
        )[:, None]  # [r, 1]
        expect = (cols[None, None, :] >= start[:, None, None]) & (cols[None, :] <= pos_q)[None]
        if window > 0:
            expect = expect & (cols[None, :] > pos_q - window)[None]
        real = (pos_q[None, :, 0] >= start[:, None]) & ~padding_only[:, None]  # [B, r]
        bad = bad | ((expect != rows) & real[:, :, None]).any()
    if bool(bad):
        raise UnsupportedModelError(
            f"{name}: the attention mask is not 'left padding + causal"
            + (f" + sliding window {window}" if window else "")
            + "', the only patterns kvquant's paged kernels apply (right padding, packed "
            "sequences, document masks or custom 4D masks are not supported). Fix: pad on the "
            "left (tokenizer.padding_side = 'left') and pass the 2D padding mask."
        )
    return start.to(torch.int32)


def _full_mask(query: torch.Tensor, t: int, window: int) -> torch.Tensor:
    """Boolean causal mask ``[1, 1, Lq, T]`` (True = attend): the newest ``Lq`` of ``T`` positions."""
    lq = query.shape[2]
    pos_q = torch.arange(t - lq, t, device=query.device)[:, None]
    cols = torch.arange(t, device=query.device)[None, :]
    visible = cols <= pos_q
    if window > 0:
        visible = visible & (cols > pos_q - window)
    return visible[None, None]


def fallback_kwargs(
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    s_aux: torch.Tensor | None,
) -> dict[str, Any]:
    """The keywords :func:`fallback_attention` takes: dropout and scaling, and the optional
    window, softcap and sinks only where the model passed them."""
    extra: dict[str, Any] = {"dropout": dropout, "scaling": scaling}
    optional = {"sliding_window": sliding_window, "softcap": softcap, "s_aux": s_aux}
    extra.update({name: value for name, value in optional.items() if value is not None})
    return extra


def fallback_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention on dense K/V by the implementation the model had before :func:`kvquant.patch`.

    ``"sdpa"`` and any other registered implementation that takes a 4D mask
    run through ``ALL_ATTENTION_FUNCTIONS``. ``"eager"`` runs the model's own
    ``eager_attention_forward`` with the additive float mask transformers'
    eager mask function builds (kvquant's mask function builds the boolean
    SDPA mask, or None where plain causal attention suffices: both are
    converted); so do flash and flex implementations (they need their own mask
    format) and an unknown previous implementation (a model loaded straight
    into kvquant): eager is exact for every model, sinks and softcaps included.

    Args:
        module: the attention module.
        query: ``[B, Hq, Lq, D]``.
        key: ``[B, Hkv, T, D]``.
        value: ``[B, Hkv, T, D]``.
        attention_mask: kvquant's boolean mask ``[B, 1, Lq, T]`` or None.
        **kwargs: the call's other keywords (``scaling``, ``dropout``,
            ``sliding_window``, ``softcap``, ...), passed on.

    Returns:
        ``(attn_output [B, Lq, Hq, D], attention weights or None)``.
    """
    previous = getattr(module, FALLBACK_ATTR, None)
    if (
        previous in (None, ATTN_NAME)
        or previous.startswith(("flash", "flex"))
        or previous not in ALL_ATTENTION_FUNCTIONS
    ):
        previous = "eager"  # unknown (e.g. loaded straight into kvquant) or its own mask format
    if previous == "eager":
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if callable(eager):
            mask = attention_mask
            if mask is None:
                mask = _full_mask(query, key.shape[2], int(kwargs.get("sliding_window") or 0))
            if mask.dtype == torch.bool:
                floor = torch.finfo(query.dtype).min
                mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(
                    ~mask, floor
                )
            out: tuple[torch.Tensor, torch.Tensor | None] = eager(
                module, query, key, value, mask, **kwargs
            )
            return out
        previous = "sdpa"
    result: tuple[torch.Tensor, torch.Tensor | None] = ALL_ATTENTION_FUNCTIONS[previous](
        module, query, key, value, attention_mask, **kwargs
    )
    return result


def kvquant_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention over kvquant's FP8 paged cache (transformers ``AttentionInterface`` signature).

    In a compiled decode step (the decoder layer got kvquant's step tensors as
    the keyword :data:`~kvquant.integrations.hf.step_ops.STEP_KWARG`) it stores
    the new token's K/V and attends through kvquant's custom ops
    (:func:`~kvquant.integrations.hf.step_ops.step_attention_call`), which
    ``torch.compile`` traces into the layer's graph. Every other call runs
    :func:`_paged_attention`, marked ``torch.compiler.disable``: a
    ``torch.compile`` of a patched model breaks its graph there cleanly instead
    of tracing the cache's Python bookkeeping and the kernel launches; outside
    ``torch.compile`` it is a plain call.

    Args:
        module: the attention module (``layer_idx``, ``scaling``).
        query: ``[B, Hq, Lq, D]`` after RoPE.
        key: None when the layer's K/V are in kvquant's pages; else dense ``[B, Hkv, T, D]``
            (then :func:`fallback_attention` computes the call), or the new token's keys
            in a compiled decode step.
        value: like ``key``.
        attention_mask: boolean ``[B, 1, Lq, T]`` (True = attend) or None (plain causal).
        scaling: softmax scale; default ``module.scaling``.
        dropout: must be 0 in training mode over kvquant's cache.
        sliding_window: window of a sliding-window layer, or None.
        softcap: logit softcap, or None.
        s_aux: ``[Hq]`` learned attention-sink logits (gpt-oss), or None.
        **kwargs: other keywords from the model (position ids, ...), unused.

    Returns:
        ``(attn_output [B, Lq, Hq, D] in the query dtype, None)`` (the fallback's
        weights for dense K/V).

    Raises:
        UnsupportedModelError: dropout during training, or an unsupported mask pattern.
        KVQuantError: K/V are missing and the layer's kvquant cache cannot be found.
    """
    batch = kwargs.pop(BATCH_KWARG, None)
    if batch is not None and key is not None and value is not None:
        # transformers' continuous batching (5.24): the batching cache stored this layer's K/V
        return batch.attend(  # type: ignore[no-any-return]
            module,
            query,
            key,
            value,
            scaling=scaling,
            dropout=dropout,
            sliding_window=sliding_window,
            softcap=softcap,
            s_aux=s_aux,
        )
    step = kwargs.pop(STEP_KWARG, None)
    if step is not None and key is not None and value is not None:
        return step_attention_call(
            module, step, query, key, value, scaling, sliding_window, softcap, s_aux
        )
    return _paged_attention(
        module,
        query,
        key,
        value,
        attention_mask,
        scaling=scaling,
        dropout=dropout,
        sliding_window=sliding_window,
        softcap=softcap,
        s_aux=s_aux,
        **kwargs,
    )


@torch.compiler.disable
def _paged_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`kvquant_attention` outside a compiled decode step's custom ops (see there).

    A compiled decode step whose decoder layer did not hand kvquant's step
    tensors on to the attention function lands here too: the module's
    ``STEP_LAYER_ATTR`` names its cache layer, which stores the new token's K/V
    (a graph break, logged once per attention class).
    """
    step_layer: KVQuantLayer | None = module.__dict__.get(STEP_LAYER_ATTR)
    if step_layer is not None and key is not None and value is not None:
        # A compiled decode step: the layer got no cache, so these are the new token's K/V.
        _log_step_break(module)
        step_layer.update(key, value)
        key = value = None
    if key is not None and value is not None:
        # Dense K/V: a prompt with no cached prefix, or a forward without a kvquant cache
        # (use_cache=False, gradients): the model's previous attention implementation, so the
        # call (and its gradients) is exactly the unpatched model's.
        fresh = _layer_of(module)
        if fresh is not None and fresh.pending_first is not None:
            # k-transform: keep the prompt's first visible tokens at full precision
            fresh.flush_first_tokens(_first_visible(fresh, attention_mask, query, module))
        extra = fallback_kwargs(dropout, scaling, sliding_window, softcap, s_aux)
        return fallback_attention(module, query, key, value, attention_mask, **extra, **kwargs)
    if dropout and module.training:
        raise UnsupportedModelError(
            f"{_name(module)}: attention dropout {dropout} in training mode; kvquant's FP8 cache "
            "is for inference. Fix: model.eval(), or pass use_cache=False (kvquant then runs the "
            "model's own attention on bf16 K/V)."
        )
    sm_scale = float(scaling if scaling is not None else getattr(module, "scaling", 0.0))
    if sm_scale <= 0:
        sm_scale = 1.0 / math.sqrt(query.shape[-1])
    window = int(sliding_window or 0)
    cap = float(softcap or 0.0)
    layer = step_layer if step_layer is not None else _layer_of(module)
    storage = None if layer is None else layer.storage
    if layer is None or storage is None:
        raise UnsupportedModelError(
            f"{_name(module)}: kvquant's attention got no K/V and found no kvquant cache layer on "
            "the module (the forward pre-hook installed by kvquant.patch did not run). Fix: call "
            "kvquant.patch(model) again, and pass the cache as a keyword argument."
        )
    cache = layer.cache
    kv_start = _kv_start(layer, attention_mask, query.shape[2], window, module)
    if layer.pending_first is not None:
        layer.flush_first_tokens(_first_visible(layer, attention_mask, query, module))
    out = storage.attend(
        query.transpose(1, 2),
        cache.book.block_table(storage.device),
        cache.book.lens(layer.seq_len, query.device),
        sm_scale=sm_scale,
        rows=cache.book.window,
        kv_start=kv_start,
        causal=True,
        softcap=cap,
        window=window,
        sinks=None if s_aux is None else _sinks(layer, s_aux),
    )
    return out, None


def _kv_start(
    layer: KVQuantLayer,
    attention_mask: torch.Tensor | None,
    q_len: int,
    window: int,
    module: nn.Module,
) -> torch.Tensor | None:
    """The call's per-sequence first visible key (left padding), memoised per mask on the cache."""
    cache = layer.cache
    memo = cache.kv_start_memo
    static = cache.book.static
    if static is not None:
        return static.kv_start  # a CUDA-graph decode step: checked by its runner
    if attention_mask is None:
        cache.kv_start_memo = None  # no mask: no padding
        return None
    if memo is not None and memo[0] is attention_mask and memo[1] == window:
        return memo[2]
    # A refused mask raises after this layer stored the call's tokens: kvquant.patch's
    # decoder hook then rolls the whole cache back to where the forward began.
    kv_start = kv_start_from_mask(attention_mask, layer.seq_len, q_len, window, _name(module))
    cache.kv_start_memo = (attention_mask, window, kv_start) if kv_start is not None else None
    return kv_start


def _first_visible(
    layer: KVQuantLayer, attention_mask: torch.Tensor | None, query: torch.Tensor, module: nn.Module
) -> torch.Tensor | None:
    """Each sequence's first visible position for the k-transform's first tokens (None: 0).

    A sequence with no real token yet (all padding so far) gets ``seq_len``: its
    first tokens are still to come.
    """
    if attention_mask is None:
        return None
    cache = layer.cache
    # The layers of one forward share the mask; a weak reference keeps a prompt's large
    # mask from outliving its forward.
    memo = cache.first_visible_memo
    if memo is not None and memo[0]() is attention_mask and memo[1] == layer.seq_len:
        return memo[2]
    starts = kv_start_from_mask(
        attention_mask, layer.seq_len, query.shape[2], 0, _name(module), raw=True
    )
    cache.first_visible_memo = (weakref.ref(attention_mask), layer.seq_len, starts)
    return starts


def _sinks(layer: KVQuantLayer, s_aux: torch.Tensor) -> torch.Tensor:
    """The model's sink logits as the kernels take them (fp32, contiguous), kept per cache layer.

    The same converted tensor serves every step while the parameter is unchanged, so the
    kernels' value check reads it once.
    """
    try:
        version = int(s_aux._version)
    except RuntimeError:  # an inference tensor
        version = -1
    memo = layer.__dict__.get("_kvq_sinks")
    if memo is not None and memo[0] is s_aux and memo[1] == version:
        sinks: torch.Tensor = memo[2]
        return sinks
    sinks = s_aux.detach().to(torch.float32).contiguous()
    layer.__dict__["_kvq_sinks"] = (s_aux, version, sinks)
    return sinks

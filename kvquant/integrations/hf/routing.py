"""Which cache a patched model's forward uses, and the hooks that route it: the decoder pre-hook
that decides the cache and claims the model for the calling thread, the attention modules' cache
hooks, and the rollback of a forward that raises. Rules: ``docs/dev/patch.md``."""

from __future__ import annotations

import sys
import threading
from typing import Any, NoReturn

import torch
from torch import nn

from kvquant.errors import (
    CacheUsageError,
    UnsupportedModelError,
)
from kvquant.integrations.hf import attention as _attention
from kvquant.integrations.hf import continuous as _continuous
from kvquant.integrations.hf.cache_layer import KVQuantCache
from kvquant.integrations.hf.compat import cache_argument, call_cache, unwrap_cache
from kvquant.integrations.hf.marks import STATE_ATTR
from kvquant.integrations.hf.state import PatchState

__all__ = [
    "Injector",
    "IsActive",
    "PatchBound",
    "Rollback",
    "drop_cache",
    "grab_cache",
    "kvquant_cache",
    "plain_dynamic",
    "prefill_length_hint",
    "settle",
    "wants_cache",
]


# ---------------------------------------------------------------------- hooks


def grab_cache(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    setattr(module, _attention.CACHE_ATTR, unwrap_cache(call_cache(kwargs)))


def drop_cache(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    setattr(module, _attention.CACHE_ATTR, None)


def _grad_flows(decoder: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether this forward records gradients through K/V (autograd on, a weight or input trainable)."""
    if not torch.is_grad_enabled():
        return False
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.requires_grad:
        return True
    return any(p.requires_grad for p in decoder.parameters())


def wants_cache(kwargs: dict[str, Any], config: Any) -> bool:
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(config, "use_cache", True)
    return bool(use_cache)


def prefill_length_hint(kwargs: dict[str, Any]) -> int | None:
    """Tokens per sequence a chunked prefill will reach, read from the chunk's padding mask.

    transformers' chunked prefill (``prefill_chunk_size``) gives each chunk the
    whole prompt's 2D mask sliced to the chunk's end: a view whose rows keep the
    whole prompt's stride. That stride is the hint (the pools then grow once, at
    the first chunk, instead of at every chunk); None for a forward of one token,
    a mask of its own shape, or anything else. Only sizing reads it.
    """
    mask = kwargs.get("attention_mask")
    new = kwargs.get("input_ids")
    if new is None:
        new = kwargs.get("inputs_embeds")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not isinstance(new, torch.Tensor):
        return None
    rows, cols = mask.shape
    row = mask.stride(0)
    if new.dim() < 2 or new.shape[1] < 2 or rows < 1 or mask.stride(1) != 1 or row <= cols:
        return None
    held = mask.untyped_storage().nbytes() // mask.element_size()
    if mask.storage_offset() + (rows - 1) * row + row > held:
        return None  # not the rows of one [B, T] mask
    return int(row)


def plain_dynamic(cache: Any) -> bool:
    """Whether ``cache`` is a transformers ``DynamicCache`` that kvquant may convert (when empty)."""
    from transformers.cache_utils import DynamicCache

    return type(cache) is DynamicCache and not getattr(cache, "offloading", False)


def kvquant_cache(current: Any, model: nn.Module) -> KVQuantCache:
    """The kvquant cache of a call that passed ``current`` (checked by the caller): the cache
    itself, a new one for None, or the empty plain ``DynamicCache`` converted in place."""
    if isinstance(current, KVQuantCache):
        return current
    if current is None:
        return KVQuantCache(model)
    return _adopt_dynamic_cache(current, model)


def _adopt_dynamic_cache(cache: Any, model: nn.Module) -> KVQuantCache:
    """Turn the user's empty ``DynamicCache`` object itself into a :class:`KVQuantCache`.

    The caller keeps a reference to the object it passed (a manual decode loop
    passes the same object at every step, ``generate(past_key_values=...)``
    returns it), so replacing it by a new cache would lose the context the next
    call must see. Converting the object in place keeps its identity: every
    later call, and the user's own ``get_seq_length()``, see the FP8 context.
    The object was empty, so nothing it held is lost; ``generate``'s mark of a
    user-provided cache is kept.
    """
    marks = {k: v for k, v in vars(cache).items() if k == "_is_user_defined"}
    fresh = KVQuantCache(model)
    cache.__class__ = KVQuantCache
    vars(cache).clear()
    vars(cache).update(vars(fresh))
    vars(cache).update(marks)
    for layer in cache.layers:
        layer.cache = cache
    adopted: KVQuantCache = cache
    return adopted


def _refuse_cache(cache: Any, name: str) -> NoReturn:
    """Raise :class:`CacheUsageError` for a cache kvquant's attention cannot read."""
    from transformers.cache_utils import DynamicCache

    kind = type(cache).__name__
    fix = (
        "Fix: pass handle.new_cache() (or an empty DynamicCache, which kvquant converts), or no "
        "cache at all (generate then builds kvquant's), or handle.remove() to run without kvquant."
    )
    if getattr(cache, "offloading", False):
        raise CacheUsageError(
            f"{name}: got an offloaded {kind} (cache_implementation='offloaded' or "
            "offloading=True); kvquant's FP8 pages stay on the model's device and cannot be "
            f"offloaded. {fix}"
        )
    if type(cache) is DynamicCache:
        raise CacheUsageError(
            f"{name}: got a DynamicCache that already holds {cache.get_seq_length()} positions in "
            "the model's dtype (filled without kvquant); kvquant's attention reads only its own "
            "FP8 pages and cannot continue from it. Fix: start from handle.new_cache() (or an "
            "empty DynamicCache) and run the prompt again with the patched model."
        )
    if getattr(cache, "is_compileable", False):
        raise CacheUsageError(
            f"{name}: got a {kind} (cache_implementation='static' or 'sliding_window', a "
            "StaticCache object, or generate's torch.compile route through them); kvquant's "
            "attention reads only its own FP8 pages, and generate's static route compiles the "
            "whole model around a fixed-size cache, which kvquant's growing paged cache (its "
            "page tables kept on the host) cannot be; a forward over this cache would attend "
            "without kvquant. Nothing was written. Fix: drop cache_implementation (generate "
            "then uses kvquant's FP8 cache; on CUDA its decode steps replay a CUDA graph of "
            "compiled decoder layers, compile_step=None), or handle.remove() to compile the "
            "model without kvquant."
        )
    raise CacheUsageError(
        f"{name}: got a {kind} (e.g. cache_implementation='quantized'); kvquant's "
        "attention reads only its own FP8 pages (a KVQuantCache), and a forward over another "
        f"cache would attend without kvquant and without the mask that cache needs. {fix}"
    )


class PatchBound:
    """A callable of the patch (hook, wrapper predicate) that holds its model and state.

    They are attributes, not a closure's cells: ``copy.deepcopy(model)`` copies
    the hooks and wrappers on the model with it, and a copied object refers to
    the copy's model and state where a copied function would keep the original's.
    """

    def __init__(self, model: nn.Module, state: PatchState) -> None:
        self.model = model
        self.state = state

    def active(self) -> bool:
        """Whether this patch is still the one applied to the model."""
        return getattr(self.model, STATE_ATTR, None) is self.state


class IsActive(PatchBound):
    """The wrappers' ``is_active`` predicate."""

    def __call__(self) -> bool:
        return self.active()


class Injector(PatchBound):
    """Decoder forward pre-hook: decides the call's cache (module docstring) and claims the
    model for the calling thread (released by :class:`Rollback`)."""

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        state, model = self.state, self.model
        if not self.active():
            return None
        _claim(state, module)
        key, current = cache_argument(kwargs)
        if _continuous.is_batching_cache(current):
            return None  # transformers' continuous batching over kvquant's pages (the continuous package)
        grad = _grad_flows(module, kwargs)
        name = state.model_name
        plain = plain_dynamic(current)
        if isinstance(current, KVQuantCache):
            if current.patch_id != state.patch_id:
                _refuse_foreign(current, state)
            if grad:
                raise UnsupportedModelError(
                    f"{name}: a forward with gradients (torch.is_grad_enabled() and trainable "
                    "weights or inputs) over a kvquant cache: FP8 pages carry no gradient, so the "
                    "K/V projections would get wrong gradients. Nothing was written. Fix: run "
                    "inference under torch.no_grad() / torch.inference_mode() (generate does), or "
                    "train with use_cache=False and no cache (kvquant then runs the model's own "
                    "attention on bf16 K/V, exactly)."
                )
        elif current is None:
            if grad or not wants_cache(kwargs, state.text_config):
                return None  # no kvquant cache: the model's own attention on bf16 K/V
        elif grad and plain:
            return None  # training over the user's bf16 cache: exactly the unpatched model
        elif not plain or current.get_seq_length() != 0:
            _refuse_cache(current, name)
        output_attentions = kwargs.get("output_attentions")
        if output_attentions is None:
            output_attentions = getattr(state.text_config, "output_attentions", False)
        if output_attentions:
            raise UnsupportedModelError(
                f"{name}: output_attentions=True with kvquant's cache; the paged FP8 kernels never "
                "form the attention-weight matrix. Nothing was written. Fix: pass "
                "output_attentions=False, or use_cache=False for that forward (kvquant then runs "
                "the model's own attention, which returns the weights)."
            )
        cache = kvquant_cache(current, model)
        cache.length_hint = prefill_length_hint(kwargs)
        settle(cache)
        cache.rollback_point = cache.get_seq_length()
        if cache is current:
            return None
        kwargs = dict(kwargs)
        kwargs[key or state.raw_context.get("cache_kwarg", "cache")] = cache
        return args, kwargs


@torch.compiler.disable  # dynamo cannot trace threading.get_ident (torch.compile(model.forward))
def _claim(state: PatchState, decoder: nn.Module) -> None:
    """Mark the model's decoder as running in this thread, or refuse another thread's forward.

    The attention modules hold the cache of the current forward (the attention
    function never receives it), so two threads' forwards at once would read
    each other's caches. ``dict.setdefault`` claims atomically. A claim whose
    thread is no longer inside a call of ``decoder`` (it ended, or a
    ``KeyboardInterrupt`` stopped its forward, after which torch runs no forward
    hook) is taken over; a decoder forward never runs inside another of the
    same model, so this thread's own leftover claim is simply kept.

    Raises:
        UnsupportedModelError: another thread is in a forward of this model.
    """
    me = threading.get_ident()
    owner = state.running.setdefault("thread", me)
    if owner == me:
        return
    if _calling(owner, decoder):
        raise UnsupportedModelError(
            f"{state.model_name}: a forward in thread {me} while thread {owner} runs one on "
            "the same kvquant-patched model; the patch keeps the cache of the running forward "
            "on the attention modules, so concurrent forwards would read each other's caches. "
            "Nothing was written. Fix: call generate / forward on this model from one thread "
            "at a time (a threading.Lock around the calls), or give each thread its own model "
            "(copy.deepcopy(model) of the patched model is patched too)."
        )
    state.running["thread"] = me


def _calling(thread: int, module: nn.Module) -> bool:
    """Whether ``thread`` is inside a call of ``module`` (torch's ``Module._call_impl`` frame).

    False on a torch without that function: the claim is then taken over, as
    before the guard existed, rather than refusing a thread whose forward ended.
    """
    if _CALL_IMPL is None:
        return False
    frame = sys._current_frames().get(thread)
    while frame is not None:
        if frame.f_code is _CALL_IMPL and frame.f_locals.get("self") is module:
            return True
        frame = frame.f_back
    return False


_CALL_IMPL = getattr(getattr(nn.Module, "_call_impl", None), "__code__", None)


@torch.compiler.disable  # as _claim
def _release(state: PatchState) -> None:
    """End this thread's :func:`_claim` (a forward that another thread's claim refused holds
    none, so it releases nothing)."""
    if state.running.get("thread") == threading.get_ident():
        state.running.clear()


def settle(cache: KVQuantCache) -> None:
    """Crop a cache that a stopped forward left part-written back to where that forward began.

    The rollback hook records where a forward began (``rollback_point``) and
    clears it when the forward ends; a ``KeyboardInterrupt`` skips torch's
    forward hooks, leaving the earlier layers longer than the rest. The next
    forward over the cache finds the mark and crops first (outside a row group
    or a static decode step, which set their own bookkeeping).
    """
    point = cache.rollback_point
    if point is not None and cache.book.window is None and cache.book.static is None:
        cache.truncate(point)
        cache.rollback_point = None


def _refuse_foreign(cache: KVQuantCache, state: PatchState) -> NoReturn:
    """Raise :class:`CacheUsageError` for a ``KVQuantCache`` that another patch built."""
    raise CacheUsageError(
        f"{state.model_name}: got a KVQuantCache built by another kvquant.patch (of "
        f"{cache.model_name}, or of this model before it was patched again); its layers carry "
        "that patch's scales, page size and layer layout, which would quantize this model's "
        "K/V with the wrong scales. Nothing was written. Fix: pass a cache of this model's "
        "current patch (handle.new_cache(), or the cache one of its calls returned), or no cache."
    )


class Rollback(PatchBound):
    """Decoder forward hook (``always_call``): a failed forward leaves the cache as it found it.

    The cache's layers store a call's tokens one layer after the other; a
    forward that raises in a later layer (a refused mask in a sliding-window
    layer, a bad input, an out-of-memory error) would leave the earlier layers
    longer than the rest. The injector records the cache's length before the
    forward; this hook crops every layer back to it when the forward raised
    (torch then calls it with ``output=None``). It also ends the thread's claim
    of the model (:func:`_claim`).
    """

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        _release(self.state)
        if output is None:
            # The forward raised: an attention module it stopped in kept the call's cache
            # (its own forward hook did not run), which would hold the pages alive.
            for site in self.state.sites:
                setattr(site.module, _attention.CACHE_ATTR, None)
        cache = call_cache(kwargs)
        if not isinstance(cache, KVQuantCache):
            return
        point, cache.rollback_point = cache.rollback_point, None
        if output is None and point is not None:
            cache.truncate(point)

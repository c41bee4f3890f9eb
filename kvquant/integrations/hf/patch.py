"""``kvquant.patch(model)``: give a transformers model kvquant's FP8 paged KV cache.

What :func:`patch` does, in order (everything that can fail is checked before
the model is touched):

1. checks the family (:mod:`kvquant.integrations.hf.models`) and finds every
   attention module;
2. gets the raw KV scales (a checkpoint folder, an in-memory mapping, or
   ``model.name_or_path``) and resolves them through the registry
   (:func:`kvquant.registry.resolve_scales`): a
   :class:`~kvquant.errors.ScaleFormatError` is raised here, before any change;
3. installs the canonical fp32 scales as buffers ``k_scale`` / ``v_scale`` of
   each attention module (static formats only);
4. registers the ``"kvquant"`` attention and mask functions and switches the
   model's attention implementation to it;
5. installs forward pre-hooks (removable handles): one per attention module
   that records the cache of the current call on the module (the attention
   function never receives the cache object), and two on the decoder: a
   pre-hook that decides the cache of the call (below) and a forward hook
   that rolls the whole cache back when the forward raises.

The cache of a decoder forward (``cache=`` on 5.24, ``past_key_values=`` on 5.17):

- a :class:`~kvquant.integrations.hf.cache_layer.KVQuantCache` this patch built: used as
  it is (one of another patch: :class:`~kvquant.errors.CacheUsageError`);
- none: a new ``KVQuantCache`` when the forward uses a cache, else none
  (``use_cache=False``);
- an empty plain ``DynamicCache`` (what ``generate`` creates, or the user's
  own object in a manual loop or ``generate(past_key_values=DynamicCache())``):
  converted in place into a ``KVQuantCache``, so the object the caller holds
  carries the FP8 context into its next call;
- anything else (a ``DynamicCache`` that already holds bf16 K/V, an
  offloaded, static or quantized cache): :class:`~kvquant.errors.CacheUsageError`
  before anything runs.

A forward with gradients (autograd on and a trainable weight or input) gets
no kvquant cache: it runs the model's previous attention implementation on
bf16 K/V (exact forward and gradients; a plain ``DynamicCache`` passes
through); a ``KVQuantCache`` passed to such a forward is refused, since FP8
pages carry no gradient. ``output_attentions=True`` over a kvquant cache is
refused (the kernels never form the weights).

Why a pre-hook for ``generate``: transformers 5.24 has no registry of
``cache_implementation`` names (the accepted names are a fixed tuple), and the
alternatives (overriding ``_prepare_cache_for_generation``, wrapping
``generate``) replace model methods. A forward pre-hook is a documented torch
seam, works identically on transformers 5.17 and 5.24 and for plain forward
calls, and is undone by its handle. ``generate`` keeps whatever cache the model
returns, so the swap holds for every later step.

All state lives on the model instance (``model._kvquant_state``); the only
process-global effect is the registration of the ``"kvquant"`` names.
"""

from __future__ import annotations

import copy
import inspect
import logging
import sys
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, NoReturn, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from kvquant.errors import (
    CacheUsageError,
    OptionError,
    OptionTypeError,
    ScaleFormatError,
    UnsupportedModelError,
)
from kvquant.integrations.hf import attention as _attention
from kvquant.integrations.hf import continuous as _continuous
from kvquant.integrations.hf.cache_layer import ATTN_NAME, KVQuantCache, LayerSpec
from kvquant.integrations.hf.config import PatchOptions, check_option_names
from kvquant.integrations.hf.graphs import (
    CompiledLayers,
    DecodeGraphRunner,
    release_library_workspaces,
)
from kvquant.integrations.hf.models import (
    AttentionSite,
    check_supported,
    decoder_layers,
    find_attention_sites,
    model_geometry,
    text_config,
)
from kvquant.integrations.hf.rowgroups import RowGroupForward
from kvquant.integrations.transformers_quantizer import KVQuantConfig
from kvquant.kernels.backend import resolve_backend
from kvquant.types import LayerGeometry, RawScale

__all__ = ["KVQuantHandle", "PatchOptions", "PatchState", "patch"]

_logger = logging.getLogger("kvquant")

STATE_ATTR = "_kvquant_state"


class _Missing:
    """The mark of an attribute that was absent before the patch (``saved_attrs``).

    One object, also through ``copy.deepcopy`` and pickling (a copied patched
    model must recognise it when its handle restores the attributes).
    """

    def __reduce__(self) -> str:
        return "_MISSING"

    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()
_SCALE_ATTRS = ("k_scale", "v_scale")


@dataclass
class PatchState:
    """Everything :func:`patch` changed on one model (kept on ``model._kvquant_state``).

    Attributes:
        options: the patch settings.
        sites: the attention modules.
        layer_specs: per layer, what the cache layer needs (scales, granularity).
        model_scales: the registry's resolved scales (with its report).
        raw_scales: the raw scales they came from (reused when re-patching).
        text_config: the decoder config (its ``_attn_implementation`` is switched).
        previous_attn: the attention implementation before the patch.
        model_name: for messages.
        handles: removable hook handles.
        saved_attrs: ``(module, name, previous value or _MISSING, kind)`` to restore.
        graph_runner: the CUDA-graph decode runner installed as the model's
            ``forward`` (unless ``cuda_graphs=False``), else None.
        row_groups: the row-group prefill wrapper installed as the model's
            ``forward`` (around the graph runner, if any) when ``prefill_tokens``
            is set, else None.
        handle: the handle :func:`patch` returned.
        patch_id: identifies the patch; every :class:`KVQuantCache` it builds
            carries it, and a forward refuses a cache of another patch (another
            model, or this model before it was patched again with other options).
        running: ``{"thread": ident}`` while a thread runs a decoder forward of
            the model (a forward from another thread is refused).
    """

    options: PatchOptions
    sites: list[AttentionSite]
    layer_specs: list[LayerSpec]
    model_scales: Any
    raw_scales: list[RawScale]
    raw_context: dict[str, Any]
    text_config: Any
    previous_attn: str | None
    model_name: str
    handles: list[RemovableHandle] = field(default_factory=list)
    saved_attrs: list[tuple[nn.Module, str, Any, str]] = field(default_factory=list)
    graph_runner: DecodeGraphRunner | None = None
    row_groups: RowGroupForward | None = None
    handle: KVQuantHandle | None = None
    patch_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    running: dict[str, int] = field(default_factory=dict)

    def __deepcopy__(self, memo: dict[int, Any]) -> PatchState:
        """The state of ``copy.deepcopy(model)``: a patch of its own (new ``patch_id``, idle)."""
        copied = PatchState.__new__(PatchState)
        memo[id(self)] = copied
        for f in fields(self):
            setattr(copied, f.name, copy.deepcopy(getattr(self, f.name), memo))
        copied.patch_id = uuid.uuid4().hex
        copied.running = {}
        return copied


class KVQuantHandle:
    """What :func:`patch` returns: the patch's state, and :meth:`remove` to undo it.

    Usable as a context manager (``with kvquant.patch(model): ...``).
    """

    def __init__(self, model: nn.Module, state: PatchState) -> None:
        self._model = model
        self.state = state

    @property
    def active(self) -> bool:
        """Whether the patch is still applied to the model."""
        return getattr(self._model, STATE_ATTR, None) is self.state

    @property
    def scales(self) -> Any:
        """The registry's resolved scales (``ModelScales``) installed on the model."""
        return self.state.model_scales

    def new_cache(
        self,
        *,
        max_cache_tokens: int | None = None,
        num_pages: int | None = None,
        page_size: int | None = None,
    ) -> KVQuantCache:
        """A fresh :class:`KVQuantCache` for this model (pass it as ``cache=`` / ``past_key_values=``)."""
        return KVQuantCache(
            self._model, max_cache_tokens=max_cache_tokens, num_pages=num_pages, page_size=page_size
        )

    def remove(self) -> None:
        """Undo the patch: hooks, buffers, attributes and attention implementation (idempotent).

        A model loaded with ``quantization_config=KVQuantConfig()`` also loses
        that config and its quantizer (transformers'
        ``HfQuantizer.remove_quantization_config``), so it saves and reloads as
        a plain model.
        """
        if not self.active:
            return
        _unpatch(self._model, self.state)
        quantizer = self.state.raw_context.get("quantizer")
        if quantizer is not None:
            quantizer.remove_quantization_config(self._model)

    def __enter__(self) -> KVQuantHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        grans = sorted({s.granularity for s in self.state.layer_specs})
        return (
            f"KVQuantHandle({self.state.model_name}, layers={len(self.state.layer_specs)}, "
            f"granularity={'/'.join(grans)}, active={self.active})"
        )


# ---------------------------------------------------------------------- options


# ---------------------------------------------------------------------- scales


def _in_model_scales(sites: list[AttentionSite]) -> dict[str, torch.Tensor]:
    """Scale tensors already on the attention modules (e.g. compressed-tensors on 5.17)."""
    found: dict[str, torch.Tensor] = {}
    for site in sites:
        for attr in ("k_scale", "v_scale", "kv_scale"):
            value = getattr(site.module, attr, None)
            if isinstance(value, torch.Tensor) and not getattr(value, "_kvq_canonical", False):
                found[f"{site.name}.{attr}"] = value.detach().cpu()
    return found


def gather_raw_scales(
    model: nn.Module,
    sites: list[AttentionSite],
    geometry: LayerGeometry,
    scales: str | Path | Mapping[str, torch.Tensor] | None,
    dynamic: bool = False,
) -> tuple[list[RawScale], dict[str, Any], str]:
    """Find the raw KV scales for ``model``.

    Args:
        model: the model.
        sites: its attention modules.
        geometry: its attention geometry.
        scales: a checkpoint folder or hub id, a ``{tensor_name: tensor}``
            mapping, or None (the model's own checkpoint, from
            ``model.name_or_path`` as a folder or through the local Hugging
            Face cache; else scale tensors already on the attention modules,
            else none).
        dynamic: the scale format is dynamic (``fp32-group``), so an explicit
            mapping may name no KV scale (``scales={}``: read nothing).

    Returns:
        ``(raw scales, context for the registry, source description)``.

    Raises:
        CheckpointError: a folder that is not a checkpoint, or the model's own
            checkpoint cannot be found although its config declares quantization.
        ScaleFormatError: the folder's geometry does not match the model, or a
            mapping names no KV scale.
    """
    from kvquant.checkpoint.discovery import (
        discover_scales,
        raw_scales_from_mapping,
        raw_scales_from_state_dict,
    )
    from kvquant.checkpoint.producers.kvquant import k_transform_from_mapping
    from kvquant.checkpoint.sources import model_checkpoint

    if isinstance(scales, (str, Path)):
        found = discover_scales(scales)
        raws, ctx = checkpoint_scales(found, geometry, str(scales), loaded_from=False)
        return raws, ctx, f"checkpoint {found.path}"
    if isinstance(scales, Mapping):
        raws = raw_scales_from_mapping(scales, "kvquant.patch: scales", allow_none=dynamic)
        transform = k_transform_from_mapping(scales, geometry, "kvquant.patch: scales")
        return raws, {"k_transform": transform} if transform else {}, "mapping"
    if scales is not None:
        raise OptionTypeError(
            f"kvquant.patch: scales is a {type(scales).__name__}; expected a checkpoint folder "
            "(str or Path), a {tensor_name: tensor} mapping, or None."
        )
    folder = model_checkpoint(model)
    if folder is not None:
        found = discover_scales(folder)
        raws, ctx = checkpoint_scales(found, geometry, str(folder), loaded_from=True)
        if found.scales:
            return raws, ctx, f"checkpoint {folder}"
    in_model = _in_model_scales(sites)
    if in_model:
        return raw_scales_from_state_dict(in_model), {}, "model attributes"
    if folder is not None:
        return [], {"discovered": found}, f"checkpoint {folder} (no KV scales)"
    return [], {}, "none"


def _is_dynamic(scale_format: Any) -> bool:
    """Whether ``scale_format`` names a dynamic format (one that uses no stored scale)."""
    from kvquant.errors import UnknownFormatError
    from kvquant.registry import ScaleFormat, get_scale_format

    if isinstance(scale_format, ScaleFormat):
        return bool(scale_format.dynamic)
    if not isinstance(scale_format, str) or scale_format == "auto":
        return False
    try:
        return bool(get_scale_format(scale_format).dynamic)
    except UnknownFormatError:
        return False  # the registry reports the unknown name when resolving


def refuse_error_findings(found: Any, where: str) -> None:
    """Raise when discovery found checkpoint-level errors (unsupported KV scheme, zero points, ...).

    Raises:
        ScaleFormatError: listing every error finding.
    """
    errors = [f for f in getattr(found, "findings", ()) if f.severity == "error"]
    if errors:
        lines = "; ".join(f"[{f.code}] {f.message}" for f in errors)
        raise ScaleFormatError(f"{where}: kvquant cannot use this checkpoint's KV scales: {lines}")


def checkpoint_scales(
    found: Any, geometry: LayerGeometry, where: str, *, loaded_from: bool
) -> tuple[list[RawScale], dict[str, Any]]:
    """A discovered checkpoint's raw scales for a model of ``geometry``, after checking that they fit.

    The checkpoint's config must describe the model. A model loaded from the
    checkpoint (``loaded_from``) with fewer layers, whose layers are the
    checkpoint's first ones (a draft model for assisted decoding, loaded with
    ``num_hidden_layers=M``: transformers loads those layers' weights), gets
    those layers' scales, as it gets their weights; a folder named explicitly
    (``scales=``) must describe the whole model.

    Returns:
        ``(raw scales, context for the registry)``.

    Raises:
        ScaleFormatError: the geometries differ otherwise, or discovery found
            checkpoint-level errors.
    """
    full = found.geometry
    kept = geometry.num_layers
    ctx: dict[str, Any] = {"discovered": found}
    if full.num_layers <= kept:
        _check_geometry(full, geometry, where)
        refuse_error_findings(found, where)
        return list(found.scales), ctx
    first = LayerGeometry.from_layers(
        full.num_heads,
        [full.kv_heads_of(i) for i in range(kept)],
        [full.head_dim_of(i) for i in range(kept)],
    )
    try:
        _check_geometry(first, geometry, where)
    except ScaleFormatError:
        _check_geometry(full, geometry, where)  # the message names the whole checkpoint
        raise
    if not loaded_from:
        raise ScaleFormatError(
            f"{where}: the checkpoint config has {full.num_layers} layers, the model {kept} "
            "layers like its first ones; kvquant gives a model a checkpoint's first layers only "
            "when the model was loaded from that checkpoint (e.g. a draft model loaded with "
            f"num_hidden_layers={kept}). Fix: leave scales unset if the model was loaded from "
            "this folder (kvquant.patch(model)), else pass the checkpoint the model was "
            "loaded from."
        )
    refuse_error_findings(found, where)
    transform = found.k_transform
    if transform is not None:
        offsets = tuple(o for o in transform.offsets if o.layer < kept)
        ctx["k_transform"] = replace(transform, offsets=offsets)
    _logger.info(
        "kvquant: the model has the first %d of the %d layers of %s (a model loaded with "
        "num_hidden_layers=%d, e.g. a draft model): it gets their KV scales.",
        kept,
        full.num_layers,
        where,
        kept,
    )
    return [r for r in found.scales if r.layer < kept], ctx


def _check_geometry(found: LayerGeometry, model: LayerGeometry, where: str) -> None:
    """Refuse a checkpoint whose config does not describe ``model``.

    The checkpoint's geometry comes from its ``config.json``; a model whose
    layers differ in KV heads matches a per-layer config layer by layer, and a
    model-wide ``num_key_value_heads`` when that count is one of its layers'.
    """
    kv_counts = sorted({model.kv_heads_of(i) for i in range(model.num_layers)})
    head_dims = sorted({model.head_dim_of(i) for i in range(model.num_layers)})
    per_layer = found.uniform or found.layer_num_kv_heads == model.layer_num_kv_heads
    per_layer_dims = found.layer_head_dims is None or found.layer_head_dims == model.layer_head_dims
    if (
        found.num_layers != model.num_layers
        or found.num_kv_heads not in kv_counts
        or not per_layer
        or found.head_dim not in head_dims
        or not per_layer_dims
    ):
        heads = "/".join(str(h) for h in kv_counts)
        dims = "/".join(str(d) for d in head_dims)
        raise ScaleFormatError(
            f"{where}: the checkpoint config has {found.num_layers} layers and "
            f"{found.num_kv_heads} KV heads of head_dim {found.head_dim}, the model "
            f"{model.num_layers} layers and {heads} KV heads of head_dim {dims}. Fix: pass "
            "the checkpoint the model was loaded from."
        )


def _host_scale(scale: torch.Tensor) -> torch.Tensor:
    """An fp32 CPU copy of a canonical scale, pinned where CUDA is available.

    Every cache copies the scales to its device when a layer's storage is built,
    inside the first forward; from pinned memory that copy does not wait for the
    GPU work already queued (a pageable copy would, once per layer).
    """
    host = scale.detach().to(device="cpu", dtype=torch.float32).clone()
    return host.pin_memory() if torch.cuda.is_available() else host


def _layer_specs(
    sites: list[AttentionSite], geometry: LayerGeometry, model_scales: Any
) -> list[LayerSpec]:
    layers = list(model_scales.layers)
    if len(layers) != len(sites):
        raise UnsupportedModelError(
            f"the registry resolved {len(layers)} layers of scales for {len(sites)} attention "
            "layers."
        )
    reused = {s.kv_source for s in sites if s.kv_source is not None}
    specs = []
    for i, (site, ls) in enumerate(zip(sites, layers, strict=True)):
        gran = str(ls.granularity)
        k = None if ls.k is None else _host_scale(ls.k)
        v = None if ls.v is None else _host_scale(ls.v)
        transform = getattr(model_scales, "k_transform", None)
        offset = getattr(ls, "k_offset", None)
        specs.append(
            LayerSpec(
                name=site.name,
                num_kv_heads=geometry.kv_heads_of(i),
                head_dim=geometry.head_dim_of(i),
                granularity=gran,
                k_scale=k,
                v_scale=v,
                group_size=int(ls.group_size) if ls.group_size else None,
                k_offset=None if offset is None else _host_scale(offset),
                rotation=None if transform is None else transform.rotation,
                first_tokens=0 if transform is None else int(transform.first_tokens),
                kv_reused=i in reused,
            )
        )
    return specs


def _same_specs(a: list[LayerSpec], b: list[LayerSpec]) -> bool:
    """Whether two patches' layer specs are equal (scale tensors compared by value)."""

    def same(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            return x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return False
        return bool(x == y)

    return len(a) == len(b) and all(
        same(getattr(s, f.name), getattr(t, f.name))
        for s, t in zip(a, b, strict=True)
        for f in fields(s)
    )


def resolve(
    raw: list[RawScale], geometry: LayerGeometry, opts: PatchOptions, ctx: dict[str, Any]
) -> Any:
    """Resolve raw scales into canonical per-layer scales through the registry.

    Raises:
        ScaleFormatError: the registry rejects the scales.
    """
    from kvquant.registry import resolve_scales

    discovered = ctx.get("discovered")
    transform = ctx.get("k_transform", getattr(discovered, "k_transform", None))
    return resolve_scales(raw, geometry, options=opts.resolve_options, k_transform=transform)


# ---------------------------------------------------------------------- hooks


def cache_kwarg_name(module: nn.Module) -> str:
    """``"cache"`` (transformers 5.24) or ``"past_key_values"`` (5.17) for ``module.forward``."""
    params = inspect.signature(type(module).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _unwrap_cache(obj: Any) -> Any:
    """The real cache behind compressed-tensors' ``QuantizedKVCache`` wrapper (5.17), else ``obj``."""
    if obj is None or isinstance(obj, KVQuantCache):
        return obj
    inner = getattr(obj, "past_key_values", None)
    if callable(inner) and isinstance(obj, nn.Module):
        try:
            return inner()
        except TypeError:
            return obj
    return obj


def _grab_cache(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    setattr(module, _attention.CACHE_ATTR, _unwrap_cache(cache))


def _drop_cache(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    setattr(module, _attention.CACHE_ATTR, None)


def _grad_flows(decoder: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether this forward records gradients through K/V (autograd on, a weight or input trainable)."""
    if not torch.is_grad_enabled():
        return False
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.requires_grad:
        return True
    return any(p.requires_grad for p in decoder.parameters())


def _wants_cache(kwargs: dict[str, Any], config: Any) -> bool:
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(config, "use_cache", True)
    return bool(use_cache)


def _cache_argument(kwargs: dict[str, Any]) -> tuple[str | None, Any]:
    """The call's cache keyword (``cache`` on transformers 5.24, ``past_key_values`` on 5.17;
    None when the call names neither) and the object it passes there."""
    key = next((n for n in ("cache", "past_key_values") if n in kwargs), None)
    return key, (kwargs.get(key) if key else None)


def _plain_dynamic(cache: Any) -> bool:
    """Whether ``cache`` is a transformers ``DynamicCache`` that kvquant may convert (when empty)."""
    from transformers.cache_utils import DynamicCache

    return type(cache) is DynamicCache and not getattr(cache, "offloading", False)


def _kvquant_cache(current: Any, model: nn.Module) -> KVQuantCache:
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


class _PatchBound:
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


class _IsActive(_PatchBound):
    """The wrappers' ``is_active`` predicate."""

    def __call__(self) -> bool:
        return self.active()


class _Injector(_PatchBound):
    """Decoder forward pre-hook: decides the call's cache (module docstring) and claims the
    model for the calling thread (released by :class:`_Rollback`)."""

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        state, model = self.state, self.model
        if not self.active():
            return None
        _claim(state, module)
        key, current = _cache_argument(kwargs)
        if _continuous.is_batching_cache(current):
            return None  # transformers' continuous batching over kvquant's pages (continuous.py)
        grad = _grad_flows(module, kwargs)
        name = state.model_name
        plain = _plain_dynamic(current)
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
            if grad or not _wants_cache(kwargs, state.text_config):
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
        cache = _kvquant_cache(current, model)
        _settle(cache)
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


def _settle(cache: KVQuantCache) -> None:
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


class _Rollback(_PatchBound):
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
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not isinstance(cache, KVQuantCache):
            return
        point, cache.rollback_point = cache.rollback_point, None
        if output is None and point is not None:
            cache.truncate(point)


# ---------------------------------------------------------------------- apply / undo


class _CanonicalStateDict:
    """A ``state_dict`` post-hook writing the canonical fp32 scales, whatever the buffers became.

    ``model.to(torch.float16)`` casts every floating buffer, so a 1e-10 scale
    would be saved as 0.0 and 0.0123 as its bf16 rounding; the saved scales are
    the exact canonical fp32 ones instead (on the buffer's device). An object,
    not a closure, so that a patched model pickles (``torch.save(model)``).
    """

    def __init__(self, spec: LayerSpec) -> None:
        self.spec = spec

    def __call__(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, meta: Any
    ) -> None:
        for attr, value in _canonical_buffers(self.spec):
            key = prefix + attr
            if value is not None and key in state_dict:
                state_dict[key] = value.to(device=state_dict[key].device, dtype=torch.float32)


def _canonical_buffers(spec: LayerSpec) -> tuple[tuple[str, torch.Tensor | None], ...]:
    """The canonical tensors a patched attention module holds as buffers (and saves).

    A ``k-transform`` layer also holds its ``k_offset``: a model saved after the
    patch then carries the offsets, and discovery refuses the copy (offsets
    without ``kvquant_kv_transform.json``) instead of loading its K scales
    without the transform they were calibrated for.
    """
    out: tuple[tuple[str, torch.Tensor | None], ...] = (
        ("k_scale", spec.k_scale),
        ("v_scale", spec.v_scale),
    )
    if spec.k_offset is not None:
        out += (("k_offset", spec.k_offset),)
    return out


class _ScaleLoad(_PatchBound):
    """``load_state_dict`` pre-hook of the model: its kvquant scale buffers keep the patch's values.

    Every cache copies the scales the patch resolved (``LayerSpec``), not the
    buffers, so a state dict with other scale values would change the buffers
    (and ``model.k_scale``) but not the quantization. A state dict without the
    scale keys (the unpatched model's) gets the patch's own, so it loads
    without missing keys; one with the same values (any shape holding them, as
    ``state_dict()`` of the patched model) loads; other values are refused
    before anything is loaded (the hook runs before the first module loads).
    """

    def __call__(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        *rest: Any,
    ) -> None:
        if not self.active():
            return
        names = {id(m): n for n, m in module.named_modules()}
        for site, spec in zip(self.state.sites, self.state.layer_specs, strict=True):
            if id(site.module) not in names:
                continue
            for attr, value in _canonical_buffers(spec):
                buffer = site.module._buffers.get(attr)
                if value is None or buffer is None:
                    continue
                key = f"{prefix}{names[id(site.module)]}.{attr}"
                given = state_dict.get(key, value)
                if not (
                    isinstance(given, torch.Tensor)
                    and given.numel() == value.numel()
                    and torch.equal(
                        given.detach().to("cpu", torch.float32).reshape(value.shape), value
                    )
                ):
                    found = (
                        given.detach().flatten()[:4].tolist()
                        if isinstance(given, torch.Tensor)
                        else type(given).__name__
                    )
                    raise ScaleFormatError(
                        f"{self.state.model_name}.load_state_dict: {key} holds {found}, not the "
                        f"scale the kvquant patch resolved ({value.flatten()[:4].tolist()}); "
                        "kvquant's "
                        "caches use the resolved scales, so loading others into the buffers would "
                        "not change the quantization. Nothing was loaded. Fix: "
                        "kvquant.patch(model, scales=state_dict) first (it resolves the new "
                        "scales), then load_state_dict; or load the checkpoint with "
                        "kvquant.from_pretrained."
                    )
                loaded = value.to(device=buffer.device, dtype=buffer.dtype).clone()
                loaded._kvq_canonical = True  # type: ignore[attr-defined]  # kept by assign=True
                state_dict[key] = loaded


def _install_scales(state: PatchState) -> None:
    for site, spec in zip(state.sites, state.layer_specs, strict=True):
        mod = site.module
        for attr, value in _canonical_buffers(spec):
            prev: Any = _MISSING
            kind = "absent"
            if attr in mod._buffers:
                prev, kind = mod._buffers[attr], "buffer"
                del mod._buffers[attr]
            elif attr in mod._parameters:
                prev, kind = mod._parameters[attr], "param"
                del mod._parameters[attr]
            elif attr in mod.__dict__:
                prev, kind = mod.__dict__[attr], "attr"
                del mod.__dict__[attr]
            if value is None and kind == "absent":
                continue
            state.saved_attrs.append((mod, attr, prev, kind))
            if value is not None:
                device = _module_device(mod)
                buf = value.to(device=device, dtype=torch.float32).clone()
                buf._kvq_canonical = True  # type: ignore[attr-defined]
                mod.register_buffer(attr, buf, persistent=True)
        if spec.k_scale is not None or spec.v_scale is not None:
            state.handles.append(mod.register_state_dict_post_hook(_CanonicalStateDict(spec)))
        if hasattr(mod, "kv_cache"):
            # compressed-tensors' own KV fake-quant hook (transformers 5.17): K/V would be
            # rounded twice. Keep its hook (it forwards to our cache), switch its quantization off.
            prev_flag = mod.__dict__.get("quantization_enabled", _MISSING)
            state.saved_attrs.append((mod, "quantization_enabled", prev_flag, "attr"))
            mod.__dict__["quantization_enabled"] = False


def _compiled_layers(model: nn.Module, state: PatchState) -> CompiledLayers | None:
    """The decoder layers for compiled decode steps, or None.

    None for ``compile_step=False``, and in auto mode where a layer's ``forward``
    is already wrapped (accelerate's device hooks, for instance).

    Raises:
        UnsupportedModelError: ``compile_step=True`` and a layer's ``forward`` is wrapped.
    """
    if state.options.compile_step is False:
        return None
    layers = decoder_layers(model)
    wrapped = [i for i, layer in enumerate(layers) if "forward" in layer.__dict__]
    if wrapped:
        if state.options.compile_step:
            raise UnsupportedModelError(
                f"{state.model_name}: decoder layers {wrapped[:4]} have an instance-level "
                "forward (a wrapper such as accelerate's device hooks) that compiling the "
                "layer class's forward would bypass. Fix: kvquant.patch(model, "
                "compile_step=False), or load the model on one device without offloading."
            )
        return None
    return CompiledLayers(layers, [site.module for site in state.sites])


def _install_forward_wrappers(model: nn.Module, state: PatchState, graphs: bool) -> None:
    """Wrap the instance's ``forward`` (restored by ``remove()``), if any wrapper is on.

    The :class:`DecodeGraphRunner` (``graphs``) around the previous forward, and the
    :class:`~kvquant.integrations.hf.rowgroups.RowGroupForward` (``prefill_tokens``)
    around that: decode steps pass the row-group check at once, prefills the runner's.
    """
    tokens = state.options.prefill_tokens
    if not graphs and tokens is None:
        return
    bound = None if tokens is None or tokens == "auto" else int(cast(int, tokens))
    compiled = _compiled_layers(model, state) if graphs else None
    prev = model.__dict__.get("forward", _MISSING)
    state.saved_attrs.append((model, "forward", prev, "attr"))
    active = _IsActive(model, state)
    forward = model.forward
    if graphs:
        runner = DecodeGraphRunner(
            model, forward, active, compiled=compiled, compile_step=state.options.compile_step
        )
        state.graph_runner = runner
        forward = runner
    if tokens is not None:
        groups = RowGroupForward(model, forward, active, bound, _RowGroupCache(model, state))
        state.row_groups = groups
        forward = groups
    model.__dict__["forward"] = forward


class _RowGroupCache(_PatchBound):
    """The :data:`~kvquant.integrations.hf.rowgroups.CachePreparer` of the model.

    The kvquant cache a call will use, made before the first row group so that
    every group shares it: the call's ``KVQuantCache`` (of this patch); a new one
    for no cache (when the call uses a cache); the user's empty ``DynamicCache``,
    converted in place (as the decoder hook would). None for anything else (the
    call then runs whole, and the decoder hook refuses or passes it).
    """

    def __call__(self, kwargs: dict[str, Any]) -> tuple[str, KVQuantCache] | None:
        state = self.state
        key, current = _cache_argument(kwargs)
        if current is None and not _wants_cache(kwargs, state.text_config):
            return None
        if not (
            current is None
            or (isinstance(current, KVQuantCache) and current.patch_id == state.patch_id)
            or (_plain_dynamic(current) and current.get_seq_length() == 0)
        ):
            return None
        cache = _kvquant_cache(current, self.model)
        _settle(cache)
        return key or state.raw_context.get("cache_kwarg", "cache"), cache


def _module_device(mod: nn.Module) -> torch.device:
    """Where ``mod``'s scale buffers go: its weights' device, CPU for weights on ``meta``.

    accelerate's ``device_map`` offload leaves offloaded weights on ``meta`` and
    loads them for each forward; a buffer registered on ``meta`` would hold no
    data and ``save_pretrained`` could not write it. kvquant's attention reads
    its own copy of the scales (beside the pages), so a CPU buffer serves
    ``state_dict()`` and saving.
    """
    for p in mod.parameters():
        return torch.device("cpu") if p.device.type == "meta" else p.device
    return torch.device("cpu")


def _restore_attrs(state: PatchState) -> None:
    for mod, attr, prev, kind in reversed(state.saved_attrs):
        mod._buffers.pop(attr, None)
        mod._parameters.pop(attr, None)
        mod.__dict__.pop(attr, None)
        if prev is _MISSING:
            continue
        if kind == "buffer":
            mod._buffers[attr] = prev
        elif kind == "param":
            mod._parameters[attr] = prev
        else:
            setattr(mod, attr, prev)
    state.saved_attrs.clear()


def _set_attn(model: nn.Module, name: str | None) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if name is None:
        return
    if callable(setter):
        setter(name)
    else:  # pragma: no cover - every PreTrainedModel has it
        text_config(model)._attn_implementation = name


def _unpatch(model: nn.Module, state: PatchState) -> None:
    for h in state.handles:
        h.remove()
    state.handles.clear()
    for site in state.sites:
        site.module.__dict__.pop(_attention.CACHE_ATTR, None)
    _restore_attrs(state)
    if state.previous_attn is not None and state.previous_attn != ATTN_NAME:
        _set_attn(model, state.previous_attn)
    if getattr(model, STATE_ATTR, None) is state:
        delattr(model, STATE_ATTR)
    if state.graph_runner is not None:
        release_library_workspaces()


def apply_patch(
    model: nn.Module,
    opts: PatchOptions,
    sites: list[AttentionSite],
    geometry: LayerGeometry,
    model_scales: Any,
    raw: list[RawScale],
    ctx: dict[str, Any],
) -> KVQuantHandle:
    """Install already-resolved scales, hooks and the attention function on ``model``.

    Used by :func:`patch` and by the load-time quantizer. Undone by the handle.

    Raises:
        UnsupportedModelError: the model refuses the ``"kvquant"`` attention implementation.
        OptionError: ``cuda_graphs=True`` for a model whose layers share K/V.
    """
    _check_graphs(model, opts, sites)
    specs = _layer_specs(sites, geometry, model_scales)
    cfg = text_config(model)
    previous = getattr(cfg, "_attn_implementation", None)
    state = PatchState(
        options=opts,
        sites=sites,
        layer_specs=specs,
        model_scales=model_scales,
        raw_scales=raw,
        raw_context=dict(ctx),
        text_config=cfg,
        previous_attn=previous,
        model_name=type(model).__name__,
    )
    state.raw_context["cache_kwarg"] = cache_kwarg_name(getattr(model, "base_model", model))
    _attention.register()
    setattr(model, STATE_ATTR, state)
    try:
        _install_scales(state)
        if any(s.k_scale is not None or s.v_scale is not None for s in specs):
            state.handles.append(model.register_load_state_dict_pre_hook(_ScaleLoad(model, state)))
        for site in sites:
            prev_fb = site.module.__dict__.get(_attention.FALLBACK_ATTR, _MISSING)
            state.saved_attrs.append((site.module, _attention.FALLBACK_ATTR, prev_fb, "attr"))
            site.module.__dict__[_attention.FALLBACK_ATTR] = previous
        for site in sites:
            state.handles.append(
                site.module.register_forward_pre_hook(_grab_cache, with_kwargs=True)
            )
            state.handles.append(site.module.register_forward_hook(_drop_cache, with_kwargs=True))
        decoder = getattr(model, "base_model", model)
        state.handles.append(
            decoder.register_forward_pre_hook(_Injector(model, state), with_kwargs=True)
        )
        state.handles.append(
            decoder.register_forward_hook(
                _Rollback(model, state), with_kwargs=True, always_call=True
            )
        )
        _install_forward_wrappers(
            model, state, graphs=opts.cuda_graphs is not False and not _shares_kv(sites)
        )
        state.handles.append(_continuous.install(model, state))  # type: ignore[arg-type]
        _set_attn(model, ATTN_NAME)
        if getattr(cfg, "_attn_implementation", None) != ATTN_NAME:
            raise UnsupportedModelError(
                f"{type(model).__name__} did not switch its attention implementation to "
                f"{ATTN_NAME!r} (it stays {getattr(cfg, '_attn_implementation', None)!r}); "
                "remote-code models that do not use transformers' AttentionInterface cannot run "
                "kvquant. Fix: use a transformers-native model class."
            )
    except BaseException:
        _unpatch(model, state)
        raise
    handle = KVQuantHandle(model, state)
    state.handle = handle
    _logger.info(_decision_line(model, state))
    return handle


def _shares_kv(sites: list[AttentionSite]) -> bool:
    """Whether some layers attend over another layer's K/V (Gemma 4's KV sharing).

    Such a model decodes without the CUDA-graph runner: the shared layers attend
    over the K/V their source layer's update returns, which a graph step does not
    produce.
    """
    return any(s.kv_source is not None for s in sites)


def _check_graphs(model: nn.Module, opts: PatchOptions, sites: list[AttentionSite]) -> None:
    """Refuse ``cuda_graphs=True`` for a model whose layers share K/V (before any change).

    Raises:
        OptionError: ``cuda_graphs=True`` and some layers attend over another layer's K/V.
    """
    if opts.cuda_graphs and _shares_kv(sites):
        raise OptionError(
            f"kvquant.patch: cuda_graphs=True, but {type(model).__name__} has layers that attend "
            "over another layer's K/V (KV sharing), which kvquant's CUDA-graph decode step does "
            "not serve. Fix: pass cuda_graphs=None (such a model decodes eagerly)."
        )


def _decision_line(model: nn.Module, state: PatchState) -> str:
    """The one INFO line :func:`patch` logs: what was found, the format, backend, cache sizing."""
    opts = state.options
    grans = "/".join(sorted({s.granularity for s in state.layer_specs}))
    found = state.raw_context.get("discovered")
    producer = getattr(found, "producer", None)
    source = opts.source or "none"
    if producer not in (None, "none"):
        source += f", {producer} convention"
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    backend = opts.backend
    if backend == "auto":
        backend = f"auto -> {resolve_backend('auto', device, 'kvquant.patch')} on {device.type}"
    if opts.num_pages is not None:
        sizing = f"{opts.num_pages} pages of {opts.page_size} tokens per cache"
    elif opts.max_cache_tokens is not None:
        sizing = f"{opts.max_cache_tokens} token slots per cache, pages of {opts.page_size}"
    else:
        sizing = f"pages of {opts.page_size} tokens, grown on demand"
    graphs = {None: "auto (on CUDA)", True: "on", False: "off"}[opts.cuda_graphs]
    if _shares_kv(state.sites):
        graphs = "off (layers share K/V)"
    runner = state.graph_runner
    if runner is None or runner.compiled is None:
        compiled = "off" if opts.compile_step is False or runner is None else "off (wrapped layers)"
    else:
        compiled = {None: "auto (on CUDA)", True: "on", False: "off"}[opts.compile_step]
    tokens = opts.prefill_tokens
    groups = {None: "off", "auto": "auto (on CUDA, from the free memory)"}.get(
        tokens,  # type: ignore[arg-type]
        f"at most {tokens} tokens per forward",
    )
    return (
        f"kvquant.patch: {state.model_name}, {len(state.layer_specs)} layers, FP8 KV with "
        f"{grans} scales (from {source}); backend {backend}; cache: {sizing}; "
        f"decode graphs: {graphs}; compiled step: {compiled}; prefill row groups: {groups}"
    )


def _uncompiled(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile(model)`` wrapper compiles, else ``model``.

    Patching the module itself is what patching before compiling does: the
    wrapper's next call compiles the patched forward. Hooks bound to the wrapper
    would be traced inside its own compiled forward, which dynamo refuses.
    """
    # Only a process that imported dynamo can hold a compiled wrapper: patch() itself does
    # not import it (that import alone costs seconds on a first call).
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    if wrapper is None or not isinstance(model, wrapper):
        return model
    inner = model._orig_mod
    return inner if isinstance(inner, nn.Module) else model


def _reuse(model: nn.Module, handle: KVQuantHandle) -> KVQuantHandle:
    """The handle of an equal patch, with kvquant's attention switched on again.

    ``model.set_attn_implementation(...)`` after the patch keeps the FP8 cache
    but attends over its dequantized K/V with the chosen implementation;
    patching again with the same arguments returns to the paged kernels.
    """
    if getattr(handle.state.text_config, "_attn_implementation", None) != ATTN_NAME:
        _set_attn(model, ATTN_NAME)
    return handle


def patch(
    model: nn.Module,
    config: KVQuantConfig | None = None,
    *,
    scales: str | Path | Mapping[str, torch.Tensor] | None = None,
    **options: Any,
) -> KVQuantHandle:
    """Give ``model`` kvquant's FP8 paged KV cache; ``generate`` then uses it with no extra argument.

    ``kvquant.patch(model)`` uses the defaults; ``kvquant.patch(model,
    kvquant.KVQuantConfig(page_size=32))`` the given options (the same object
    ``from_pretrained(..., quantization_config=...)`` takes); keyword options,
    ``kvquant.patch(model, page_size=32)``, are short for the latter.

    Args:
        model: a transformers causal LM of a supported family
            (:data:`~kvquant.integrations.hf.models.SUPPORTED_FAMILIES`), or
            ``torch.compile(model)`` of one (the compiled module is patched).
        config: the options (:class:`~kvquant.integrations.hf.quantizer.KVQuantConfig`);
            None: ``KVQuantConfig(**options)``.
        scales: where the KV scales come from: a checkpoint folder, a
            ``{tensor_name: tensor}`` mapping (producer names, any shape the
            registry accepts), or None: the folder ``model.name_or_path`` when
            it is a local checkpoint, else scale tensors already on the
            attention modules, else none (then the ``missing_scales`` option decides).
        **options: any :class:`~kvquant.integrations.hf.quantizer.KVQuantConfig`
            option (``page_size=32``, ``backend="torch"``, ...), when no
            ``config`` is given.

    Returns:
        The patch's handle (also a context manager); ``handle.remove()`` restores
        the model. Patching again with the same arguments (the same scales,
        when ``scales`` is given) returns the same handle; with other arguments
        the old patch is removed first (after the new scales resolve), and the
        caches it built are refused from then on (``CacheUsageError``).
        ``copy.deepcopy(model)`` gives a copy patched on its own.

    Raises:
        UnsupportedModelError: the family or a feature it uses is not supported.
        ScaleFormatError: the registry rejects the scales (the model is unchanged).
        CheckpointError: ``scales`` names a folder that is not a checkpoint.
        BackendError: ``backend="triton"`` where it cannot run (a CPU model
            without ``TRITON_INTERPRET=1``, or Triton not installed).
        OptionError: a bad option value (a ``KVQuantError`` and ``ValueError``;
            :class:`~kvquant.errors.OptionTypeError` for a wrong type).
    """
    model = _uncompiled(model)
    check_supported(model)
    sites = find_attention_sites(model)
    geometry = model_geometry(model, sites)
    for site in sites:
        for attr in _SCALE_ATTRS:
            if attr in site.module.__dict__ and not isinstance(
                site.module.__dict__[attr], torch.Tensor
            ):
                raise UnsupportedModelError(
                    f"{site.name}.{attr} is already a {type(site.module.__dict__[attr]).__name__} "
                    "attribute of the model; kvquant installs its scale buffer under that name."
                )
    opts = _config_of(config, options).options()
    if opts.backend == "triton":  # fail here, not at the first generate
        param = next(model.parameters(), None)
        resolve_backend(
            "triton", param.device if param is not None else torch.device("cpu"), "kvquant.patch"
        )
    existing: PatchState | None = getattr(model, STATE_ATTR, None)
    if existing is not None and scales is None:
        same = PatchOptions(**{**opts.__dict__, "source": existing.options.source})
        if same == existing.options and existing.handle is not None:
            return _reuse(model, existing.handle)
        raw, ctx, source = existing.raw_scales, existing.raw_context, existing.options.source
    else:
        dynamic = _is_dynamic(opts.scale_format)
        raw, ctx, source = gather_raw_scales(model, sites, geometry, scales, dynamic)
    opts = PatchOptions(**{**opts.__dict__, "source": source})
    model_scales = resolve(raw, geometry, opts, ctx)
    if existing is not None:
        if (
            existing.handle is not None
            and opts == existing.options
            and _same_specs(existing.layer_specs, _layer_specs(sites, geometry, model_scales))
        ):
            return _reuse(model, existing.handle)  # the same scales again (mapping or folder)
        _unpatch(model, existing)
    return apply_patch(model, opts, sites, geometry, model_scales, raw, ctx)


def _config_of(config: object, options: dict[str, Any]) -> KVQuantConfig:
    """The one config of a :func:`patch` call: ``config``, or ``KVQuantConfig(**options)``."""
    if config is None:
        check_option_names(options, "kvquant.patch")
        return KVQuantConfig(**options)
    if not isinstance(config, KVQuantConfig):
        raise OptionTypeError(
            f"kvquant.patch: the second argument is a {type(config).__name__}; expected a "
            "kvquant.KVQuantConfig. Fix: kvquant.patch(model, kvquant.KVQuantConfig(...)), or "
            "pass the options as keywords."
        )
    if options:
        names = ", ".join(f"{k}=..." for k in options)
        raise OptionError(
            f"kvquant.patch: got a KVQuantConfig and the keyword options {names}; the options "
            "come from one place. Fix: put them in the config (KVQuantConfig(..., "
            f"{names})), or pass keywords alone."
        )
    return config

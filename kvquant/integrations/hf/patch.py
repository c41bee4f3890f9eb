"""``kvquant.patch(model)``: give a transformers model kvquant's FP8 paged KV cache.

:func:`patch` checks everything that can fail before it touches the model (the family, the
scales resolved through the registry, the options), then installs the canonical scales
(:mod:`.scale_buffers`), the ``"kvquant"`` attention, the routing hooks (:mod:`.routing`) and
the forward wrappers (:mod:`.forward_wrappers`); :class:`KVQuantHandle` undoes all of it.
State lives on the model (:mod:`.state`). How each call's cache is chosen, and why hooks
rather than overrides: ``docs/dev/patch.md``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvquant.cache import release_library_workspaces
from kvquant.checkpoint.producers import NO_PRODUCER
from kvquant.choices import KVFormat, describe_layer_formats, layer_kv_formats
from kvquant.errors import (
    OptionError,
    OptionTypeError,
    UnsupportedModelError,
)
from kvquant.integrations.hf import attention as _attention
from kvquant.integrations.hf import continuous as _continuous
from kvquant.integrations.hf.cache_layer import ATTN_NAME, KVQuantCache
from kvquant.integrations.hf.compat import cache_keyword
from kvquant.integrations.hf.config import PatchOptions, check_option_names
from kvquant.integrations.hf.forward_wrappers import install_forward_wrappers
from kvquant.integrations.hf.marks import MISSING, STATE_ATTR
from kvquant.integrations.hf.models import (
    AttentionSite,
    check_supported,
    find_attention_sites,
    model_geometry,
    text_config,
)
from kvquant.integrations.hf.routing import (
    Injector,
    Rollback,
    drop_cache,
    grab_cache,
)
from kvquant.integrations.hf.scale_buffers import ScaleLoad, install_scales
from kvquant.integrations.hf.scale_source import (
    gather_raw_scales,
    is_dynamic,
    layer_specs,
    resolve,
    same_specs,
)
from kvquant.integrations.hf.sharding import rank_specs
from kvquant.integrations.hf.state import SCALE_ATTRS, PatchState
from kvquant.integrations.transformers_quantizer import KVQuantConfig
from kvquant.kernels.backend import resolve_backend
from kvquant.schemes import Fp4Scales
from kvquant.types import LayerGeometry, RawScale

__all__ = [
    "KVQuantHandle",
    "PatchOptions",
    "PatchState",
    "apply_patch",
    "patch",
]

_logger = logging.getLogger("kvquant")


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


def _restore_attrs(state: PatchState) -> None:
    for mod, attr, prev, kind in reversed(state.saved_attrs):
        mod._buffers.pop(attr, None)
        mod._parameters.pop(attr, None)
        mod.__dict__.pop(attr, None)
        if prev is MISSING:
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
    specs = layer_specs(
        sites, geometry, model_scales, opts.kv_format, opts.k_rotation, opts.recent_tokens
    )
    per_rank = rank_specs(sites, specs)  # tensor parallelism: refused here, before any change
    cfg = text_config(model)
    previous = getattr(cfg, "_attn_implementation", None)
    state = PatchState(
        options=opts,
        sites=sites,
        layer_specs=specs,
        rank_specs=per_rank,
        model_scales=model_scales,
        raw_scales=raw,
        raw_context=dict(ctx),
        text_config=cfg,
        previous_attn=previous,
        model_name=type(model).__name__,
    )
    state.raw_context["cache_kwarg"] = cache_keyword(getattr(model, "base_model", model))
    _attention.register()
    setattr(model, STATE_ATTR, state)
    try:
        install_scales(state)
        if any(s.k_scale is not None or s.v_scale is not None for s in specs):
            state.handles.append(model.register_load_state_dict_pre_hook(ScaleLoad(model, state)))
        for site in sites:
            prev_fb = site.module.__dict__.get(_attention.FALLBACK_ATTR, MISSING)
            state.saved_attrs.append((site.module, _attention.FALLBACK_ATTR, prev_fb, "attr"))
            site.module.__dict__[_attention.FALLBACK_ATTR] = previous
        for site in sites:
            state.handles.append(
                site.module.register_forward_pre_hook(grab_cache, with_kwargs=True)
            )
            state.handles.append(site.module.register_forward_hook(drop_cache, with_kwargs=True))
        decoder = getattr(model, "base_model", model)
        state.handles.append(
            decoder.register_forward_pre_hook(Injector(model, state), with_kwargs=True)
        )
        state.handles.append(
            decoder.register_forward_hook(
                Rollback(model, state), with_kwargs=True, always_call=True
            )
        )
        install_forward_wrappers(
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
    param = next(model.parameters(), None)
    formats = _stored_formats(state)
    if set(formats) != {KVFormat.FP8} and param is not None and param.is_cuda:
        _logger.warning(
            "kvquant.patch: kv_format %s is experimental on CUDA: 4-bit decode is slower than "
            "FP8's. Fix: kv_format='fp8' (the default) for speed.",
            describe_layer_formats(formats),
        )
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


def _stored_formats(state: PatchState) -> tuple[KVFormat, ...]:
    """Each layer's format as its spec stores it (a checkpoint's 4-bit layers included)."""
    return tuple(
        KVFormat(s.scheme.kv_format()) if issubclass(s.scheme, Fp4Scales) else KVFormat.FP8
        for s in state.layer_specs
    )


def _decision_line(model: nn.Module, state: PatchState) -> str:
    """The one INFO line :func:`patch` logs: what was found, the format, backend, cache sizing."""
    opts = state.options
    found = state.raw_context.get("discovered")
    producer = getattr(found, "producer", None)
    source = opts.source or "none"
    if producer not in (None, NO_PRODUCER):
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
    shard = ""
    if state.rank_specs is not None:
        mine, whole = state.rank_specs[0].num_kv_heads, state.layer_specs[0].num_kv_heads
        shard = f" (tensor parallel: this rank caches {mine} of the {whole} KV heads of a layer)"
    formats = layer_kv_formats(opts.kv_format, len(state.layer_specs), "kvquant.patch")
    fp8 = [s.granularity for s, f in zip(state.layer_specs, formats, strict=True) if not f.four_bit]
    kv = f"FP8 KV with {'/'.join(sorted(set(fp8)))} scales (from {source})"
    if opts.k_rotation is not None:
        kv += f", K rotated ({opts.k_rotation}) before its groups"
    if any(f.four_bit for f in formats):
        kv = f"KV formats {describe_layer_formats(formats)} (4-bit scales computed on write"
        if any(f.fp8_keys for f in formats):
            kv += f"; FP8 scales from {source}"
        four_bit = [s for s, f in zip(state.layer_specs, formats, strict=True) if f.four_bit]
        if any(s.scheme.transforms_keys for s in four_bit):
            kv += "; K in the k-transform's frame"
        kv += ")"
        if opts.k_rotation is not None:
            kv += f", K rotated ({opts.k_rotation}) before its groups or blocks"
    if getattr(state.model_scales, "fp4_layers", None):
        kv = (
            f"KV formats {describe_layer_formats(_stored_formats(state))} (the checkpoint's "
            f"NVFP4 global scales; FP8 scales from {source})"
        )
    recent = state.layer_specs[0].recent_tokens if state.layer_specs else 0
    if recent:
        kv += f", each sequence's newest {recent} tokens also at full precision"
    return (
        f"kvquant.patch: {state.model_name}, {len(state.layer_specs)} layers{shard}, {kv}; "
        f"backend {backend}; cache: {sizing}; "
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
        for attr in SCALE_ATTRS:
            if attr in site.module.__dict__ and not isinstance(
                site.module.__dict__[attr], torch.Tensor
            ):
                raise UnsupportedModelError(
                    f"{site.name}.{attr} is already a {type(site.module.__dict__[attr]).__name__} "
                    "attribute of the model; kvquant installs its scale buffer under that name."
                )
    opts = _config_of(config, options).options()
    layer_kv_formats(opts.kv_format, len(sites), "kvquant.patch")  # the map fits the layers
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
        dynamic = is_dynamic(opts.scale_format)
        raw, ctx, source = gather_raw_scales(model, sites, geometry, scales, dynamic)
    opts = PatchOptions(**{**opts.__dict__, "source": source})
    model_scales = resolve(raw, geometry, opts, ctx)
    if existing is not None:
        if (
            existing.handle is not None
            and opts == existing.options
            and same_specs(
                existing.layer_specs,
                layer_specs(
                    sites,
                    geometry,
                    model_scales,
                    opts.kv_format,
                    opts.k_rotation,
                    opts.recent_tokens,
                ),
            )
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

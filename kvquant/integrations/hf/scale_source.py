"""Where a patch gets its KV scales: the checkpoint, a mapping, or the attention modules, resolved
through the registry into one :class:`~kvquant.integrations.hf.cache_layer.LayerSpec` per layer."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from kvquant.cache.storage.recent import recent_tokens_of
from kvquant.choices import KVFormat, layer_kv_formats
from kvquant.errors import (
    OptionError,
    OptionTypeError,
    ScaleFormatError,
    UnsupportedModelError,
)
from kvquant.integrations.hf.cache_layer import LayerSpec
from kvquant.integrations.hf.config import PatchOptions
from kvquant.integrations.hf.models import (
    AttentionSite,
)
from kvquant.registry.fp4 import Fp4Layer, format_mismatch, resolve_fp4_raws
from kvquant.schemes import (
    DYNAMIC_NVFP4_GLOBAL_SCALE,
    MIN_ROTATED_HEAD_DIM,
    Fp4Scales,
    Fp8KNvfp4VScales,
    GroupScales,
    KTransformMxfp4Scales,
    KTransformNvfp4Scales,
    KTransformNvfp4VScales,
    KTransformScales,
    Mxfp4Scales,
    Nvfp4Scales,
    StaticScales,
    scheme_class,
)
from kvquant.types import LayerGeometry, RawScale

__all__ = [
    "checkpoint_fp4_specs",
    "checkpoint_scales",
    "fp4_spec",
    "gather_raw_scales",
    "is_dynamic",
    "layer_specs",
    "refuse_error_findings",
    "resolve",
    "same_specs",
]

_logger = logging.getLogger("kvquant")


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


def is_dynamic(scale_format: Any) -> bool:
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


def layer_specs(
    sites: list[AttentionSite],
    geometry: LayerGeometry,
    model_scales: Any,
    kv_format: str | Mapping[int | str, str] = KVFormat.FP8,
    k_rotation: str | None = None,
    recent_tokens: int | str = 0,
) -> list[LayerSpec]:
    """One :class:`LayerSpec` per attention layer: the resolved scales, in ``kv_format``.

    A 4-bit format replaces its layer's FP8 format (:func:`fp4_spec`); a per-layer map gives
    each layer its own (:func:`~kvquant.choices.layer_kv_formats`); a checkpoint that declares
    4-bit layers gives them its formats and global scales (:func:`checkpoint_fp4_specs`).
    ``k_rotation`` (``"hadamard"``) rotates K before the ``fp32-group`` layers' scales and
    the ``nvfp4`` / ``mxfp4`` layers' blocks (a k-transform's layers bring their own).
    ``recent_tokens`` gives every layer a ring of each sequence's newest tokens (``"auto"``:
    :data:`~kvquant.cache.storage.recent.AUTO_RECENT_TOKENS`).

    Raises:
        UnsupportedModelError: the registry resolved another number of layers.
        OptionError: a map that does not fit the model's layers; ``fp8-k-nvfp4-v`` for a
            layer without static K scales; ``k_rotation`` for an FP8 layer whose scales
            resolved to a static format, a layer of the k-transform, an ``fp8-k-nvfp4-v``
            layer, a checkpoint's 4-bit layers, or a head_dim that is not a power of two >= 16.
    """
    recent = recent_tokens_of(recent_tokens)
    specs = _fp8_specs(sites, geometry, model_scales)
    formats = layer_kv_formats(kv_format, len(specs), "kvquant.patch")
    declared = getattr(model_scales, "fp4_layers", None)
    if declared:
        if k_rotation is not None:
            raise OptionError(
                f"kvquant.patch: k_rotation={str(k_rotation)!r} with a checkpoint whose layers "
                "are stored in 4 bits with its own calibrated global scales (of K as the model "
                "computes it, not rotated). Fix: drop k_rotation."
            )
        specs = checkpoint_fp4_specs(specs, declared, formats)
        return [replace(spec, recent_tokens=recent) for spec in specs]
    _log_unused_scales(specs, formats, [getattr(ls, "source", None) for ls in model_scales.layers])
    specs = [
        fp4_spec(spec, fmt) if fmt.four_bit else spec
        for spec, fmt in zip(specs, formats, strict=True)
    ]
    if k_rotation is not None:
        specs = [_rotated_spec(spec, str(k_rotation)) for spec in specs]
    return [replace(spec, recent_tokens=recent) for spec in specs]


def _log_unused_scales(
    specs: list[LayerSpec], formats: Sequence[KVFormat], sources: Sequence[object]
) -> None:
    """Warn once per patch when a 4-bit format without FP8 keys leaves static scales unused.

    ``nvfp4`` and ``mxfp4`` compute their block scales as tokens are written, so the static
    FP8 scales that the layers resolved to are not used; the user who passed a calibrated
    checkpoint should hear it. A k-transform's layers are not named: their K is stored in its
    frame (:func:`fp4_spec`). The 1.0 scales of ``missing_scales="unit"`` (``sources``: each
    layer's resolved source) are nobody's.
    """
    unused = [
        spec.name
        for spec, fmt, source in zip(specs, formats, sources, strict=True)
        if fmt.four_bit
        and not fmt.fp8_keys
        and source != "unit"
        and issubclass(spec.scheme, StaticScales)
    ]
    if unused:
        _logger.warning(
            "kvquant.patch: %d layer(s) (first %s) resolved to static FP8 KV scales, which a "
            "4-bit kv_format without FP8 keys does not use (it computes its block scales as "
            "tokens are written). To use them: kv_format='fp8', or 'fp8-k-nvfp4-v' for FP8 "
            "keys with them beside NVFP4 values.",
            len(unused),
            unused[0],
        )


def checkpoint_fp4_specs(
    specs: list[LayerSpec], declared: Mapping[int, Fp4Layer], formats: Sequence[str]
) -> list[LayerSpec]:
    """``specs`` in the 4-bit formats a checkpoint declares, with its NVFP4 global scales.

    ``formats`` (each layer's ``kv_format``) all ``"fp8"`` (the default) follows the checkpoint
    layer by layer (its FP8 layers stay FP8); else they must be the checkpoint's own formats.

    Raises:
        OptionError: formats other than the checkpoint's (:func:`~kvquant.registry.fp4.format_mismatch`),
            or a head_dim a block does not divide.
    """
    mismatch = format_mismatch(formats, declared)
    if mismatch is not None:
        raise OptionError(f"kvquant.patch: {mismatch}")
    out = []
    for i, spec in enumerate(specs):
        layer = declared.get(i)
        if layer is None:
            out.append(spec)
            continue
        kind = cast(type[Fp4Scales], scheme_class(layer.kv_format))
        plain = fp4_spec(spec, layer.kv_format)  # the block check, the 4-bit scheme
        v = _host_scale(layer.v.value) if layer.v is not None else None
        if kind is Nvfp4Scales and layer.k is not None and v is not None:
            k = _host_scale(layer.k.value)
            if k.shape != v.shape:  # one per tensor, the other per head: both per head
                k, v = (_host_scale(t.expand(spec.num_kv_heads)) for t in (k, v))
            out.append(replace(plain, k_scale=k, v_scale=v))
        else:  # fp8-k-nvfp4-v: K's static FP8 scale as resolved, V's global scale
            k = cast(torch.Tensor, plain.k_scale)
            if v is not None and v.shape != k.shape:
                k, v = (_host_scale(t.expand(spec.num_kv_heads)) for t in (k, v))
            out.append(replace(plain, k_scale=k, v_scale=v))
    return out


def fp4_spec(spec: LayerSpec, kv_format: str) -> LayerSpec:
    """``spec`` stored in a 4-bit ``kv_format`` (calibration-free).

    ``nvfp4``: global scales :data:`~kvquant.schemes.DYNAMIC_NVFP4_GLOBAL_SCALE` (fixed, so no
    statistic, sync or first batch decides them); ``mxfp4``: no scale; ``fp8-k-nvfp4-v``: the
    layer's static K scale and V's fixed global scale, of the K scale's shape. A ``k-transform``
    layer keeps its K transform (rotation, offset, first tokens): K is stored in its frame,
    4-bit (:class:`~kvquant.schemes.KTransformNvfp4Scales`,
    :class:`~kvquant.schemes.KTransformMxfp4Scales`; its static K and V scales unused) or FP8
    with its K scale (:class:`~kvquant.schemes.KTransformNvfp4VScales`).

    Raises:
        OptionError: a head_dim the format's block does not divide; ``fp8-k-nvfp4-v`` for a
            layer whose resolved format has no static K scale (dynamic ``fp32-group``).
    """
    kind = cast(type[Fp4Scales], scheme_class(str(kv_format)))  # KVFormat's words name schemes
    block = max(f.block_size for f in (kind.k_format, kind.v_format) if f is not None)
    if spec.head_dim % block:
        raise OptionError(
            f"{spec.name}: kv_format={str(kv_format)!r} stores one scale per block of {block} "
            f"channels, but the layer's head_dim is {spec.head_dim}. Fix: kv_format='nvfp4' "
            "(blocks of 16) or 'fp8' for this model."
        )
    transform = issubclass(spec.scheme, KTransformScales) and spec.k_scale is not None
    if kind is Fp8KNvfp4VScales and transform:
        # FP8 K in the K transform's frame (its offset, rotation and first tokens), NVFP4 V
        g = _host_scale(
            torch.full_like(cast(torch.Tensor, spec.k_scale), DYNAMIC_NVFP4_GLOBAL_SCALE)
        )
        return replace(spec, scheme=KTransformNvfp4VScales, group_size=None, v_scale=g)
    if transform:  # 4-bit K in the K transform's frame, V plain; block scales computed on write
        if kind is Mxfp4Scales:
            return replace(
                spec, scheme=KTransformMxfp4Scales, group_size=None, k_scale=None, v_scale=None
            )
        g = _host_scale(torch.tensor(DYNAMIC_NVFP4_GLOBAL_SCALE))
        return replace(
            spec, scheme=KTransformNvfp4Scales, group_size=None, k_scale=g, v_scale=g.clone()
        )
    plain = replace(spec, group_size=None, k_offset=None, rotation=None, first_tokens=0)
    if kind is Mxfp4Scales:
        return replace(plain, scheme=kind, k_scale=None, v_scale=None)
    if kind is Nvfp4Scales:
        g = _host_scale(torch.tensor(DYNAMIC_NVFP4_GLOBAL_SCALE))
        return replace(plain, scheme=kind, k_scale=g, v_scale=g.clone())
    if not issubclass(spec.scheme, StaticScales) or spec.k_scale is None:
        raise OptionError(
            f"{spec.name}: kv_format='fp8-k-nvfp4-v' stores K in FP8 with a static K scale, but "
            f"the layer's scales resolved to {spec.granularity!r} (no static K scale). Fix: "
            "pass the checkpoint's FP8 KV scales (scales=...), missing_scales='unit' for K "
            "within FP8's range, or kv_format='nvfp4' (no calibration)."
        )
    g = _host_scale(torch.full_like(spec.k_scale, DYNAMIC_NVFP4_GLOBAL_SCALE))
    return replace(plain, scheme=kind, v_scale=g)


def _rotated_spec(spec: LayerSpec, k_rotation: str) -> LayerSpec:
    """``spec`` of an ``fp32-group``, ``nvfp4`` or ``mxfp4`` layer with K rotated before its
    group scales or 4-bit blocks.

    Raises:
        OptionError: a layer whose K is stored in the k-transform's frame (its own rotation),
            an FP8 layer whose scales resolved to a static format, an ``fp8-k-nvfp4-v`` layer
            (refused earlier by the options' check), or a head_dim that is not a power of two
            >= 16 (a Hadamard rotation of K in the kernels' 16-channel slices).
    """
    if spec.scheme.transforms_keys:
        raise OptionError(
            f"{spec.name}: k_rotation={k_rotation!r}, but the layer's scales resolved to the "
            f"k-transform ({spec.granularity!r}), which stores K in its own frame: its "
            "rotation, offset and first tokens. Fix: drop k_rotation (the k-transform's "
            "rotation applies), or patch without the k-transform scales for a plain rotation."
        )
    if issubclass(spec.scheme, Fp4Scales) and spec.scheme.k_format is None:
        raise OptionError(
            f"{spec.name}: k_rotation={k_rotation!r} with kv_format 'fp8-k-nvfp4-v', whose FP8 K "
            "has a static scale of K as the model computes it. Fix: drop k_rotation, or pass "
            "kv_format='nvfp4'."
        )
    if spec.scheme not in (GroupScales, Nvfp4Scales, Mxfp4Scales):
        raise OptionError(
            f"{spec.name}: k_rotation={k_rotation!r} rotates K before the dynamic fp32-group "
            f"scales, but the layer's scales resolved to {spec.granularity!r} (the "
            "checkpoint's static scales). Fix: drop k_rotation, or pass "
            "scale_format='fp32-group' to compute scales as tokens are written."
        )
    d = spec.head_dim
    if d < MIN_ROTATED_HEAD_DIM or d & (d - 1):
        raise OptionError(
            f"{spec.name}: k_rotation={k_rotation!r} needs a power-of-two head_dim >= "
            f"{MIN_ROTATED_HEAD_DIM} (the Hadamard matrix), but the layer's head_dim is {d}. "
            "Fix: drop k_rotation for this model."
        )
    return replace(spec, rotation=k_rotation)


def _fp8_specs(
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
        k = None if ls.k is None else _host_scale(ls.k)
        v = None if ls.v is None else _host_scale(ls.v)
        transform = getattr(model_scales, "k_transform", None)
        offset = getattr(ls, "k_offset", None)
        specs.append(
            LayerSpec(
                name=site.name,
                num_kv_heads=geometry.kv_heads_of(i),
                head_dim=geometry.head_dim_of(i),
                scheme=ls.scheme,
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


def same_specs(a: list[LayerSpec], b: list[LayerSpec]) -> bool:
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
    scales = resolve_scales(raw, geometry, options=opts.resolve_options, k_transform=transform)
    formats = getattr(discovered, "kv_formats", None)
    if discovered is None or formats is None:
        return scales
    fp4 = resolve_fp4_raws(discovered.producer, formats, raw, geometry)
    return replace(scales, fp4_layers=fp4)

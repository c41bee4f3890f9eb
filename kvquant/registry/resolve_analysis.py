"""The analysis behind :func:`~kvquant.registry.resolve.analyze_scales`: option checks, the
format choice and the summary of every layer's decision."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvquant.errors import OptionError, OptionTypeError, ScaleFormatError
from kvquant.registry.conversions import AppliedConversion, Conversion
from kvquant.registry.formats import ScaleFormat
from kvquant.registry.options import ResolveOptions
from kvquant.registry.policy import (
    MISSING_KV_POLICIES,
    MISSING_SCALES_POLICIES,
    ROPE_POLICIES,
    check_geometry,
)
from kvquant.registry.registry import (
    ScaleFormatRegistry,
    check_format_contract,
    default_registry,
)
from kvquant.registry.resolve_dynamic import dynamic_layers
from kvquant.registry.resolve_results import BUILTIN_NAMES, ModelScales
from kvquant.registry.resolve_static import analyze_static, with_k_transform
from kvquant.schemes import KTransformScales, Scheme, scheme_class
from kvquant.types import (
    LayerGeometry,
    RawKTransform,
    RawScale,
)

__all__ = [
    "analyze_scales",
]


def _validate_options(
    scale_format: str | ScaleFormat,
    missing_scales: str,
    missing_kv: str,
    rope_policy: str,
    registry: ScaleFormatRegistry,
) -> ScaleFormat | None:
    for value, allowed, option in (
        (missing_scales, MISSING_SCALES_POLICIES, "missing_scales"),
        (missing_kv, MISSING_KV_POLICIES, "missing_kv"),
        (rope_policy, ROPE_POLICIES, "rope_policy"),
    ):
        if value not in allowed:
            raise ScaleFormatError(
                f"{option}={value!r} is not a policy; expected one of "
                f"{', '.join(map(repr, allowed))}. Fix: pass one of those."
            )
    if isinstance(scale_format, ScaleFormat):
        check_format_contract(scale_format)
        return scale_format
    if isinstance(scale_format, type) and issubclass(scale_format, ScaleFormat):
        raise ScaleFormatError(
            f"scale_format is the class {scale_format.__qualname__}; expected a format name or "
            f"an instance. Fix: pass scale_format={scale_format.__qualname__}()."
        )
    if scale_format == "auto":
        return None
    return registry.get(scale_format)


def _check_argument_types(
    raw_scales: Any, geometry: Any, options: Any, k_transform: Any
) -> list[RawScale]:
    """The raw scales as a list, after checking every argument's type (OptionTypeError)."""
    if not isinstance(geometry, LayerGeometry):
        raise OptionTypeError(
            f"resolve_scales: geometry is a {type(geometry).__name__}; expected a "
            "kvquant.LayerGeometry. Fix: pass LayerGeometry(num_layers, num_heads, num_kv_heads, "
            "head_dim), or discover_scales(path).geometry."
        )
    if isinstance(raw_scales, (str, bytes, Mapping)) or not isinstance(raw_scales, Iterable):
        raise OptionTypeError(
            f"resolve_scales: raw_scales is a {type(raw_scales).__name__}; expected a sequence "
            "of kvquant.RawScale (discover_scales(path).scales). Fix: pass a list of RawScale; "
            "for a {tensor_name: tensor} mapping, use kvquant.patch(model, scales=mapping)."
        )
    listed = list(raw_scales)  # each element is checked where it is read (ScaleFormatError)
    if options is not None and not isinstance(options, ResolveOptions):
        raise OptionTypeError(
            f"resolve_scales: options is a {type(options).__name__}; expected a "
            "kvquant.ResolveOptions or None."
        )
    if k_transform is not None and not isinstance(k_transform, RawKTransform):
        raise OptionTypeError(
            f"resolve_scales: k_transform is a {type(k_transform).__name__}; expected "
            "discover_scales(path).k_transform (a RawKTransform) or None."
        )
    return listed


def analyze_scales(
    raw_scales: Sequence[RawScale],
    geometry: LayerGeometry,
    *,
    scale_format: str | ScaleFormat = "auto",
    missing_scales: str = "dynamic",
    group_size: int | None = None,
    missing_kv: str = "error",
    rope_policy: str = "widen",
    registry: ScaleFormatRegistry | None = None,
    options: ResolveOptions | None = None,
    k_transform: RawKTransform | None = None,
) -> ModelScales:
    """Normalise every raw scale and record, per layer, what was done or what is wrong.

    Never raises for scale contents: check :attr:`ModelScales.ok` and
    :attr:`ModelScales.problems`. Arguments as in :func:`resolve_scales`.

    Raises:
        ScaleFormatError: an option value is not a policy, or the geometry is impossible.
        UnknownFormatError: ``scale_format`` names no registered format.
        FormatRegistrationError: ``scale_format`` is a format instance that breaks the contract.
        OptionTypeError: ``raw_scales``, ``geometry``, ``options`` or ``k_transform``
            of the wrong type.
    """
    raw_scales = _check_argument_types(raw_scales, geometry, options, k_transform)
    if options is not None:
        given = ResolveOptions(scale_format, missing_scales, group_size, missing_kv, rope_policy)
        if given != ResolveOptions():
            raise OptionError(
                f"options={options!r} was passed together with individual options ({given!r}); "
                "expected one or the other. Fix: put every option into the ResolveOptions."
            )
        scale_format, missing_scales = options.scale_format, options.missing_scales
        group_size, missing_kv, rope_policy = (
            options.group_size,
            options.missing_kv,
            options.rope_policy,
        )
    registry = registry if registry is not None else default_registry
    check_geometry(geometry)
    requested = _validate_options(scale_format, missing_scales, missing_kv, rope_policy, registry)
    recorded: dict[str, Any] = {
        "scale_format": requested.name if requested is not None else "auto",
        "missing_scales": missing_scales,
        "group_size": group_size,
        "missing_kv": missing_kv,
        "rope_policy": rope_policy,
    }
    if requested is not None and requested.dynamic:
        own = getattr(requested, "group_size", None)
        if group_size is None and isinstance(scale_format, ScaleFormat) and isinstance(own, int):
            group_size = own  # an instance such as Fp32GroupFormat(group_size=32)
        return _requested_dynamic(
            raw_scales, geometry, group_size, recorded, requested, k_transform
        )
    # A built-in name chooses the target granularity and formats are detected
    # per tensor; a user format reads every tensor itself. A K transform in the
    # checkpoint makes "auto" resolve to the k-transform target.
    reader = requested if requested is not None and requested.name not in BUILTIN_NAMES else None
    target: type[Scheme] | None = None
    if requested is not None:
        target = scheme_class(requested.granularity)
    elif k_transform is not None:
        target = KTransformScales
    result = analyze_static(
        raw_scales, geometry, reader, target, requested, group_size, missing_scales,
        missing_kv, rope_policy, registry, recorded,
    )  # fmt: skip
    return _with_checkpoint_transform(result, raw_scales, k_transform, requested, geometry)


def _requested_dynamic(
    raw_scales: Sequence[RawScale],
    geometry: LayerGeometry,
    group_size: int | None,
    recorded: dict[str, Any],
    requested: ScaleFormat,
    k_transform: RawKTransform | None,
) -> ModelScales:
    """A dynamic format was asked for: every layer dynamic, a checkpoint K transform noted as ignored."""
    dynamic = dynamic_layers(
        raw_scales, geometry, group_size, recorded, requested.name, explicit=True, reason=None
    )
    if k_transform is None:
        return dynamic
    note = (
        f'scale_format="{requested.name}": the checkpoint\'s K transform '
        f"({k_transform.source or 'given'}) is ignored; scales are computed while writing"
    )
    return dataclasses.replace(
        dynamic,
        notes=(*dynamic.notes, note),
        conversions=(
            *dynamic.conversions,
            AppliedConversion(
                Conversion.CHECKPOINT_IGNORED, note, tuple(range(geometry.num_layers))
            ),
        ),
    )


def _with_checkpoint_transform(
    result: ModelScales,
    raw_scales: Sequence[RawScale],
    k_transform: RawKTransform | None,
    requested: ScaleFormat | None,
    geometry: LayerGeometry,
) -> ModelScales:
    """The static result joined with the checkpoint's K transform, or the problem that forbids it."""
    if k_transform is not None and not raw_scales:
        problem = (
            f"{k_transform.source or 'the checkpoint'} declares a K transform but the checkpoint "
            "has no K/V scales; the k-transform format needs static K and V scales for every "
            "layer (model.layers.N.self_attn.k_scale / v_scale). Fix: re-run kvquant calibrate "
            'for this model, or patch(model, scale_format="fp32-group") to ignore the transform.'
        )
        return dataclasses.replace(result, problems=(*result.problems, problem))
    if result.scheme.transforms_keys:
        return with_k_transform(result, k_transform, geometry)
    if k_transform is not None and not result.scheme.dynamic:
        name = requested.name if requested is not None else "auto"
        problem = (
            f"{k_transform.source or 'the checkpoint'} declares a K transform (per-channel K "
            f'offsets) but scale_format="{name}" resolves {result.granularity} scales without '
            "it; its K scales were calibrated for the offset keys and would saturate on raw "
            'keys. Fix: scale_format="auto" or "k-transform", or "fp32-group" to ignore the '
            "checkpoint's scales."
        )
        return dataclasses.replace(result, problems=(*result.problems, problem))
    return result

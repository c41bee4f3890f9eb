"""Scale formats, their registry, and the normalise-or-reject policy.

* :mod:`~kvquant.registry.formats`: :class:`ScaleFormat` and the built-ins.
* :mod:`~kvquant.registry.registry`: :func:`register_scale_format`,
  :func:`temporary_format`, :func:`get_scale_format`.
* :mod:`~kvquant.registry.policy`: one pure function per policy step.
* :mod:`~kvquant.registry.resolve`: :func:`resolve_scales` (raises) and
  :func:`analyze_scales` (records), returning :class:`ModelScales`.
* also :mod:`~kvquant.registry.conversions`, :mod:`~kvquant.registry.options`,
  and :class:`RawScale`, :class:`LayerGeometry` from :mod:`kvquant.types`.

Imports torch only (never transformers). Reading scales out of checkpoints
lives in :mod:`kvquant.checkpoint`. Design: docs/dev/registry.md.
"""

from __future__ import annotations

from kvquant.registry.conversions import AppliedConversion, Conversion
from kvquant.registry.formats import (
    Fp32GroupFormat,
    KTransformFormat,
    PerHeadFormat,
    PerTensorFormat,
    ScaleFormat,
)
from kvquant.registry.options import ResolveOptions
from kvquant.registry.policy import FP8_E4M3_MAX, MAX_SCALE, MIN_SCALE
from kvquant.registry.registry import (
    BUILTIN_FORMATS,
    ScaleFormatRegistry,
    check_format_contract,
    default_registry,
    get_scale_format,
    register_scale_format,
    scale_format_names,
    temporary_format,
)
from kvquant.registry.resolve import (
    LayerScales,
    ModelScales,
    ScaleRecord,
    analyze_scales,
    resolve_scales,
)
from kvquant.types import Granularity, KTransform, LayerGeometry, RawKTransform, RawOffset, RawScale

__all__ = [
    "BUILTIN_FORMATS",
    "FP8_E4M3_MAX",
    "MAX_SCALE",
    "MIN_SCALE",
    "AppliedConversion",
    "Conversion",
    "Fp32GroupFormat",
    "Granularity",
    "KTransform",
    "KTransformFormat",
    "LayerGeometry",
    "LayerScales",
    "ModelScales",
    "PerHeadFormat",
    "PerTensorFormat",
    "RawKTransform",
    "RawOffset",
    "RawScale",
    "ResolveOptions",
    "ScaleFormat",
    "ScaleFormatRegistry",
    "ScaleRecord",
    "analyze_scales",
    "check_format_contract",
    "default_registry",
    "get_scale_format",
    "register_scale_format",
    "resolve_scales",
    "scale_format_names",
    "temporary_format",
]

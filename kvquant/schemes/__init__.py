"""Scale schemes, attention masks and page bundles: the frozen values the kernels and caches take.

A scheme says how stored codes turn back into numbers: :class:`PerTensorScales` and
:class:`PerHeadScales` (static fp32 K/V scales), :class:`GroupScales` (dynamic fp32 scales per
group of channels, computed on write) and :class:`KTransformScales` (static scales of K offset
and rotated first), in :mod:`~kvquant.schemes.fp8`; the 4-bit ones (e2m1 codes, block scales
computed on write) :class:`Nvfp4Scales`, :class:`Mxfp4Scales`, :class:`Fp8KNvfp4VScales` and,
K in the k-transform's frame, :class:`KTransformNvfp4Scales`, :class:`KTransformMxfp4Scales`,
:class:`KTransformNvfp4VScales`, in :mod:`~kvquant.schemes.fp4`. A scheme checks its tensors
once, when built (:mod:`~kvquant.schemes.checks`); :meth:`Scheme.to` moves it without checking.
Its ``name`` is only for messages, reports and files (:func:`scheme_class` turns a word into a
class). What the rest of kvquant needs to know about a scheme its class says (``scale_shape``,
``group_scales``, ``slot_bytes``, ``dynamic``, ``transforms_keys``): a new scheme is a new
class, not a new branch. :class:`Mask`, :class:`Pages` and :class:`FirstTokens` are in
:mod:`~kvquant.schemes.values`. Imports torch only; design: docs/dev/kernels.md (Schemes).
"""

from kvquant.schemes.base import (
    FP4_FORMATS,
    MXFP4,
    NVFP4,
    Fp4Format,
    KernelView,
    Scheme,
    fp4_format,
    scheme_class,
    scheme_names,
)
from kvquant.schemes.checks import MIN_ROTATED_HEAD_DIM, ORTHONORMAL_TOL, SCALE_MAX, SCALE_MIN
from kvquant.schemes.fp8 import (
    GroupScales,
    KTransformScales,
    PerHeadScales,
    PerTensorScales,
    StaticScales,
)

# isort: split
# the FP8 schemes register their words first: scheme_names() lists them in that order
from kvquant.schemes.fp4 import (
    DYNAMIC_NVFP4_GLOBAL_SCALE,
    Fp4Scales,
    Fp8KNvfp4VScales,
    KTransformMxfp4Scales,
    KTransformNvfp4Scales,
    KTransformNvfp4VScales,
    Mxfp4Scales,
    Nvfp4Scales,
)
from kvquant.schemes.values import CAUSAL, FirstTokens, Mask, Pages, RecentTokens

__all__ = [
    "CAUSAL",
    "DYNAMIC_NVFP4_GLOBAL_SCALE",
    "FP4_FORMATS",
    "MIN_ROTATED_HEAD_DIM",
    "MXFP4",
    "NVFP4",
    "ORTHONORMAL_TOL",
    "SCALE_MAX",
    "SCALE_MIN",
    "FirstTokens",
    "Fp4Format",
    "Fp4Scales",
    "Fp8KNvfp4VScales",
    "GroupScales",
    "KTransformMxfp4Scales",
    "KTransformNvfp4Scales",
    "KTransformNvfp4VScales",
    "KTransformScales",
    "KernelView",
    "Mask",
    "Mxfp4Scales",
    "Nvfp4Scales",
    "Pages",
    "PerHeadScales",
    "PerTensorScales",
    "RecentTokens",
    "Scheme",
    "StaticScales",
    "fp4_format",
    "scheme_class",
    "scheme_names",
]

"""One layer's FP8 K/V pages: :class:`PagedLayerStorage` (:mod:`.base`) and one subclass per
scale scheme, which ``PagedLayerStorage(..., granularity=...)`` picks: static per-tensor or
per-head scales (:mod:`.static`), dynamic ``fp32-group`` scales (:mod:`.group`) and the
``k-transform`` with its first-token side buffer (:mod:`.k_transform`), and the 4-bit
formats (:mod:`.fp4`, 4-bit or FP8 K in the k-transform's frame among them). Design:
docs/dev/cache.md."""

from __future__ import annotations

from kvquant.cache.storage.base import PagedLayerStorage, granularities
from kvquant.cache.storage.fp4 import (
    Fp4Storage,
    Fp8KNvfp4VStorage,
    KTransformFp4Storage,
    KTransformNvfp4VStorage,
)
from kvquant.cache.storage.group import GroupStorage
from kvquant.cache.storage.k_transform import KTransformStorage
from kvquant.cache.storage.static import StaticStorage
from kvquant.schemes import ORTHONORMAL_TOL

__all__ = [
    "GRANULARITIES",
    "ORTHONORMAL_TOL",
    "Fp4Storage",
    "Fp8KNvfp4VStorage",
    "GroupStorage",
    "KTransformFp4Storage",
    "KTransformNvfp4VStorage",
    "KTransformStorage",
    "PagedLayerStorage",
    "StaticStorage",
]

GRANULARITIES: tuple[str, ...] = granularities()
"""Scale granularities a :class:`PagedLayerStorage` stores."""

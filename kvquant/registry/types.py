"""Moved to :mod:`kvquant.types`; this module re-exports its names.

Kept so that ``from kvquant.registry.types import RawScale`` keeps working; new
code imports from :mod:`kvquant.types`.
"""

from __future__ import annotations

from kvquant.types import Granularity, LayerGeometry, RawScale, ScaleKind

__all__ = ["Granularity", "LayerGeometry", "RawScale", "ScaleKind"]

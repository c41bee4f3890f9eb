"""Moved to :mod:`kvquant.checkpoint.discovery`; this module re-exports its public names.

Kept so that ``from kvquant.registry.discovery import discover_scales`` keeps
working; new code imports from :mod:`kvquant.checkpoint.discovery`.
"""

from __future__ import annotations

from kvquant.checkpoint.discovery import (
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_SCALE_ELEMENTS,
    DiscoveredCheckpoint,
    Finding,
    TensorInfo,
    discover_scales,
    match_scale_name,
    raw_scales_from_mapping,
    raw_scales_from_state_dict,
    read_geometry,
    scale_tensor_infos,
)

__all__ = [
    "MAX_HEADS",
    "MAX_HEAD_DIM",
    "MAX_LAYERS",
    "MAX_SCALE_ELEMENTS",
    "DiscoveredCheckpoint",
    "Finding",
    "TensorInfo",
    "discover_scales",
    "match_scale_name",
    "raw_scales_from_mapping",
    "raw_scales_from_state_dict",
    "read_geometry",
    "scale_tensor_infos",
]

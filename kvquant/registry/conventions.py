"""Moved to :mod:`kvquant.checkpoint.producers`; this module re-exports its public names.

Kept so that ``from kvquant.registry import conventions`` keeps working; new
code imports from :mod:`kvquant.checkpoint.producers`.
"""

from __future__ import annotations

from kvquant.checkpoint.producers import (
    CONVENTION_SPECS,
    NAMINGS,
    PRODUCER_CONVENTIONS,
    ConventionSpec,
    Naming,
    compressed_tensors_config,
    compressed_tensors_kv_scheme,
    modelopt_hf_quant_config,
    modelopt_kv_cache_scheme,
    modelopt_quantization_config,
    producer_configs,
    quark_config,
    scale_tensor_name,
    stored_scale,
    stored_scale_shape,
)

__all__ = [
    "CONVENTION_SPECS",
    "NAMINGS",
    "PRODUCER_CONVENTIONS",
    "ConventionSpec",
    "Naming",
    "compressed_tensors_config",
    "compressed_tensors_kv_scheme",
    "modelopt_hf_quant_config",
    "modelopt_kv_cache_scheme",
    "modelopt_quantization_config",
    "producer_configs",
    "quark_config",
    "scale_tensor_name",
    "stored_scale",
    "stored_scale_shape",
]

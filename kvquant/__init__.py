"""kvquant: a real FP8 paged KV cache for Hugging Face transformers.

Public API. Names are resolved lazily, so ``import kvquant`` imports neither
transformers nor triton and never initialises CUDA.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvquant.errors import (
    BackendError,
    BatchingError,
    CacheCapacityError,
    CacheUsageError,
    CalibrationError,
    CheckpointError,
    ConventionError,
    ExportError,
    ExportTargetExistsError,
    FormatRegistrationError,
    KernelInputError,
    KVQuantError,
    OptionError,
    OptionTypeError,
    ScaleFormatError,
    UnknownFormatError,
    UnsupportedModelError,
    VerbosityError,
)
from kvquant.log import get_verbosity, set_verbosity

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    # registry
    "LayerGeometry": "kvquant.registry",
    "LayerScales": "kvquant.registry",
    "ModelScales": "kvquant.registry",
    "RawScale": "kvquant.registry",
    "ResolveOptions": "kvquant.registry",
    "ScaleFormat": "kvquant.registry",
    "ScaleRecord": "kvquant.registry",
    "analyze_scales": "kvquant.registry",
    "get_scale_format": "kvquant.registry",
    "register_scale_format": "kvquant.registry",
    "resolve_scales": "kvquant.registry",
    "temporary_format": "kvquant.registry",
    # discovery and the doctor's report
    "discover_scales": "kvquant.checkpoint.discovery",
    "CheckpointReport": "kvquant.report",
    "inspect_checkpoint": "kvquant.report",
    # Hugging Face integration (imports transformers on first use)
    "KVQuantCache": "kvquant.integrations.hf",
    "KVQuantConfig": "kvquant.integrations.hf",
    "KVQuantHandle": "kvquant.integrations.hf",
    "from_pretrained": "kvquant.integrations.hf",
    "patch": "kvquant.integrations.hf",
    # export for serving engines
    "export_checkpoint": "kvquant.export",
}

__all__ = [
    "BackendError",
    "BatchingError",
    "CacheCapacityError",
    "CacheUsageError",
    "CalibrationError",
    "CheckpointError",
    "ConventionError",
    "ExportError",
    "ExportTargetExistsError",
    "FormatRegistrationError",
    "KVQuantError",
    "KernelInputError",
    "OptionError",
    "OptionTypeError",
    "ScaleFormatError",
    "UnknownFormatError",
    "UnsupportedModelError",
    "VerbosityError",
    "__version__",
    "get_verbosity",
    "set_verbosity",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvquant' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

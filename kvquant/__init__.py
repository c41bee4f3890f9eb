"""kvquant: a real FP8 paged KV cache for Hugging Face transformers.

Public API. Names are resolved lazily, so ``import kvquant`` imports neither
transformers nor triton and never initialises CUDA.

``import kvquant`` also registers kvquant's quantizer with transformers (the
``"kvquant"`` ``quant_method`` that ``save_pretrained`` writes for a patched
model), so that ``AutoModelForCausalLM.from_pretrained(saved_folder)`` restores
the FP8 cache. It happens when transformers loads its quantizer registry, never
by importing transformers; if registration fails, a warning says so (and how to
load the model instead).

Documentation: https://kvquant-fp8.github.io/kvquant-fp8/ (the Quickstart first).
Design (how the registration waits for transformers): docs/dev/package.md.
"""

from __future__ import annotations

import importlib
import logging
import sys
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


_QUANTIZER_REGISTRY = "transformers.quantizers.auto"
_QUANTIZER_PLUGIN = "kvquant.integrations.transformers_quantizer"


def _register_quantizer() -> None:
    """Register kvquant's quantizer with transformers; warn (never raise) when that fails."""
    try:
        importlib.import_module(_QUANTIZER_PLUGIN).register()
    except Exception as exc:  # the caller is importing transformers: never break that
        logging.getLogger("kvquant").warning(
            "kvquant: could not register its quantizer with transformers (%s: %s); a model "
            "saved with kvquant (quant_method 'kvquant') then loads WITHOUT its FP8 KV cache. "
            "Fix: load it with kvquant.from_pretrained(path), or call kvquant.patch(model) "
            "after loading.",
            type(exc).__name__,
            exc,
        )


class _RegisteringLoader:
    """Runs transformers' quantizer registry module with its own loader, then registers kvquant's."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _remove_registration_hook()
        _register_quantizer()

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...: the real loader's
        return getattr(self._loader, name)


class _RegistrationHook:
    """A ``sys.meta_path`` finder that matches only transformers' quantizer registry module."""

    kvquant_registration_hook = True

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _QUANTIZER_REGISTRY:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if getattr(finder, "kvquant_registration_hook", False) or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def _remove_registration_hook() -> None:
    sys.meta_path[:] = [
        f for f in sys.meta_path if not getattr(f, "kvquant_registration_hook", False)
    ]


def _install_registration_hook() -> None:
    if _QUANTIZER_REGISTRY in sys.modules:
        _register_quantizer()
    elif not any(getattr(f, "kvquant_registration_hook", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegistrationHook())


_install_registration_hook()


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvquant' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

"""A benchmark script (``benchmarks/<name>.py``) loaded as a module, for the tests that run it
at tiny size or check its arithmetic."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def script_path(name: str) -> Path:
    """``benchmarks/<name>.py`` of this checkout."""
    return BENCHMARKS / f"{name}.py"


def load_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``kvquant_bench_<name>`` (registered, so that its
    dataclasses find their module)."""
    path = script_path(name)
    spec = importlib.util.spec_from_file_location(f"kvquant_bench_{name}", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module

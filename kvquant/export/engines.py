"""The engine registry: every :class:`~kvquant.export.base.Engine` ``kvquant export`` writes for."""

from __future__ import annotations

from collections.abc import Mapping

from kvquant.export.base import Engine
from kvquant.export.sglang import SGLang
from kvquant.export.tensorrt_llm import TensorRTLLM
from kvquant.export.vllm import VLLM

__all__ = ["ENGINES", "ENGINE_LIST", "engine_named", "engine_rules"]

ENGINE_LIST: tuple[Engine, ...] = (VLLM(), SGLang(), TensorRTLLM())
"""Every engine, in the order ``kvquant export --help`` and :func:`engine_rules` list them."""

_BY_NAME: Mapping[str, Engine] = {e.name: e for e in ENGINE_LIST}

ENGINES: tuple[str, ...] = tuple(_BY_NAME)
"""The serving engines :func:`~kvquant.export.export_checkpoint` writes for."""


def engine_named(name: str) -> Engine | None:
    """The engine called ``name``, or None."""
    return _BY_NAME.get(name)


def engine_rules() -> list[dict[str, str]]:
    """The engine/granularity combinations :func:`~kvquant.export.export_checkpoint` supports.

    Returns:
        One dict per combination: ``engine``, ``granularity``, ``shape`` and a ``note``.
    """
    return [
        {"engine": e.name, "granularity": g, "shape": r.shape.value, "note": r.note}
        for e in ENGINE_LIST
        for g, r in e.rules.items()
    ]

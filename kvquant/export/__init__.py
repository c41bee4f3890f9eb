"""``kvquant export``: rewrite a checkpoint's KV scales into what a serving engine's loader accepts.

:func:`export_checkpoint` reads the scales (discovery and the registry), picks the
producer convention the engine reads (:meth:`~kvquant.export.base.Engine.target`:
a source with quantized weights keeps its producer, a KV-only one gets the
engine's KV-only convention), reduces or broadcasts them to the engine's
granularity, and writes a checked copy in which only the scale shards, the index
and the quantization configs change. One engine per file (:mod:`.vllm`,
:mod:`.sglang`, :mod:`.tensorrt_llm`); the per-engine table and sources are in
``docs/export.md``, the structure in ``docs/dev/checkpoint.md``.
"""

from __future__ import annotations

from kvquant.checkpoint.producers.compressed_tensors import (
    packaged_config as compressed_tensors_config,
)
from kvquant.checkpoint.producers.compressed_tensors import (
    packaged_kv_scheme as compressed_tensors_kv_scheme,
)
from kvquant.errors import ExportError, ExportTargetExistsError
from kvquant.export.engines import ENGINES, engine_rules
from kvquant.export.report import ExportReport, LayerExport
from kvquant.export.write import REPORT_FILE, export_checkpoint, write_report_copy

__all__ = [
    "ENGINES",
    "REPORT_FILE",
    "ExportError",
    "ExportReport",
    "ExportTargetExistsError",
    "LayerExport",
    "compressed_tensors_config",
    "compressed_tensors_kv_scheme",
    "engine_rules",
    "export_checkpoint",
    "write_report_copy",
]

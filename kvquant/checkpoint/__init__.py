"""Untrusted checkpoint files in: locating a checkpoint, bounded JSON and safetensors I/O.

* :mod:`~kvquant.checkpoint.files`: locating a checkpoint, bounded reading, shard selection.
* :mod:`~kvquant.checkpoint.geometry`: the attention geometry of a ``config.json``.
* :mod:`~kvquant.checkpoint.producers`: one producer per file, and their registry.
* :mod:`~kvquant.checkpoint.discovery`: :func:`discover_scales`, the KV scales and findings.
* :mod:`~kvquant.checkpoint.scheme`: findings about declared KV schemes and FP8 weights.
* :mod:`~kvquant.checkpoint.findings`, :mod:`~kvquant.checkpoint.sources`,
  :mod:`~kvquant.checkpoint.writer` (the atomic copy export and calibrate share).

Every file is untrusted: sizes, depths, types and paths are checked, and a bad
file is a :class:`~kvquant.errors.CheckpointError`. This package imports torch
and safetensors (tqdm for the writer); transformers only where
:mod:`~kvquant.checkpoint.geometry` asks its config registry about a ``model_type``.
Developer notes: ``docs/dev/checkpoint.md``.
"""

from __future__ import annotations

from kvquant.checkpoint.files import (
    MAX_CONFIG_BYTES,
    ShardSelection,
    TensorInfo,
    locate_checkpoint,
    read_json,
    read_safetensors_header,
    select_shards,
)
from kvquant.checkpoint.findings import Finding, Severity

__all__ = [
    "MAX_CONFIG_BYTES",
    "Finding",
    "Severity",
    "ShardSelection",
    "TensorInfo",
    "locate_checkpoint",
    "read_json",
    "read_safetensors_header",
    "select_shards",
]

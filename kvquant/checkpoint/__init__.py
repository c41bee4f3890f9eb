"""Untrusted checkpoint files in: locating a checkpoint, bounded JSON and safetensors I/O.

* :mod:`~kvquant.checkpoint.findings`: :class:`Finding`.
* :mod:`~kvquant.checkpoint.producers`: the one producer table (:data:`NAMINGS`
  read by discovery, :data:`CONVENTION_SPECS` written by export, calibrate and
  the test checkpoints) and the producers' config builders.
* :mod:`~kvquant.checkpoint.discovery`: :func:`discover_scales`, the KV scales
  and findings of a checkpoint folder, loading only the scale tensors.
* :mod:`~kvquant.checkpoint.sources`: where a loaded model's checkpoint lives.
* :mod:`~kvquant.checkpoint.files`: :func:`locate_checkpoint` (a local folder,
  or a hub id resolved through the local Hugging Face cache), bounded JSON
  reading, the shard selection transformers itself makes (the index's shards,
  or ``model.safetensors`` alone), confined paths, safetensors headers read
  through ``safetensors.safe_open``.
* :mod:`~kvquant.checkpoint.writer`: :func:`~kvquant.checkpoint.writer.write_checkpoint_copy`,
  the atomic writer of a changed checkpoint copy that ``kvquant export`` and
  ``kvquant calibrate`` share.

Every file is treated as untrusted: sizes, depths, types and paths are checked,
and a bad file is a :class:`~kvquant.errors.CheckpointError`, never another
exception. This package imports torch and safetensors only (and tqdm for the writer's
progress bar). It imports transformers in one place only: discovery asks transformers'
config registry whether a ``model_type`` reads its language model from ``text_config``,
for a config that has both a top-level geometry and a ``text_config``.
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

"""Where a loaded model's checkpoint lives: its folder, or its snapshot in the local Hugging Face cache."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from kvquant.checkpoint.files import (
    INDEX_NAME,
    PICKLE_NAMES,
    SINGLE_FILE_NAME,
    locate_checkpoint,
)
from kvquant.errors import CheckpointError

__all__ = ["model_checkpoint"]

_logger = logging.getLogger("kvquant")


def _declared_quantization(config: Any) -> str | None:
    for cfg in (config, getattr(config, "text_config", None)):
        qcfg = getattr(cfg, "quantization_config", None)
        if qcfg is None:
            continue
        as_dict = qcfg if isinstance(qcfg, dict) else getattr(qcfg, "to_dict", dict)()
        return str(as_dict.get("quant_method", "unknown"))
    return None


def model_checkpoint(model: Any) -> Path | None:
    """The local checkpoint folder a transformers model was loaded from, or None.

    ``model.name_or_path`` is a local folder, or a hub id resolved through the
    local Hugging Face cache at the revision the model was loaded at
    (``config._commit_hash``); nothing is downloaded.

    Args:
        model: a transformers model (read: ``name_or_path``, ``config``).

    Returns:
        The folder, or None when the model was not loaded from a checkpoint
        (empty ``name_or_path``), or its files (``config.json`` and weights)
        cannot be found and its config declares no quantization (a warning is
        logged). A folder whose weights are ``.bin`` only is returned: discovery
        then refuses it ("safetensors only").

    Raises:
        CheckpointError: the files cannot be found although the config declares
            a ``quantization_config`` (its KV scales would be silently lost).
    """
    config = getattr(model, "config", None)
    name = getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", "") or ""
    if not name:
        return None
    local = os.path.lexists(str(name))
    revision = None if local else getattr(config, "_commit_hash", None)
    try:
        folder = locate_checkpoint(str(name), revision=revision)
    except CheckpointError as exc:
        _not_found(model, str(name), str(exc))
        return None
    weights = [n for n in (INDEX_NAME, SINGLE_FILE_NAME, *PICKLE_NAMES) if (folder / n).exists()]
    if not (folder / "config.json").exists() or not weights:
        _not_found(model, str(name), f"{folder} holds no config.json and weights")
        return None
    return folder


def _not_found(model: Any, name: str, why: str) -> None:
    """No checkpoint for ``model``: an error when its config declares quantization, else a warning."""
    method = _declared_quantization(getattr(model, "config", None))
    if method is not None:
        raise CheckpointError(
            f"{type(model).__name__} was loaded from {name!r}, whose config declares a "
            f"quantization_config (quant_method {method!r}), but kvquant cannot find its "
            f"files to read the KV scales: {why} Fix: pass "
            "kvquant.patch(model, scales=<the checkpoint folder>)."
        )
    _logger.warning(
        "kvquant: %s was loaded from %r, whose checkpoint files cannot be found (%s); its "
        "config declares no quantization, so no KV scales are read from it.",
        type(model).__name__,
        name,
        why,
    )

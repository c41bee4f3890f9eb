"""Load-time integration: ``from_pretrained(..., quantization_config=KVQuantConfig())``.

:class:`KVQuantConfig` and :class:`KVQuantizer` are registered with
transformers' quantizer plugin under ``"kvquant"``. Before the weights load,
the quantizer runs the same discovery and registry as :func:`kvquant.patch`
(any refusal happens before a weight is read) and registers placeholder buffers
at the producer's own scale names; after loading it drops them and patches the
model exactly like :func:`kvquant.patch`. ``save_pretrained`` then writes
``{"quant_method": "kvquant", ...}``, and loading that folder restores the same
model. :func:`from_pretrained` also loads checkpoints whose ``config.json``
names another quantizer (compressed-tensors, Quark; KV-only checkpoints only).

Design: docs/dev/patch.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvquant.checkpoint.files import folder_named_by, locate_checkpoint
from kvquant.checkpoint.producers import Producer, config_producer
from kvquant.errors import OptionTypeError, UnsupportedModelError
from kvquant.integrations.transformers_quantizer import SET_ASIDE, KVQuantConfig, KVQuantizer

__all__ = ["KVQuantConfig", "KVQuantizer", "from_pretrained", "quiet_loading"]

_logger = logging.getLogger("kvquant")


_HUB_KWARGS = ("revision", "cache_dir", "subfolder", "token", "trust_remote_code", "code_revision")
"""``from_pretrained`` keywords that say where the files are: the config is read with them too."""

_MODEL_DTYPE = ("dtype", "torch_dtype")
"""Keywords ``from_pretrained`` takes for loading although the config has attributes of those names."""


def from_pretrained(
    path: str | Path,
    *,
    quantization_config: KVQuantConfig | None = None,
    model_class: Any = None,
    **kwargs: Any,
) -> Any:
    """Load a causal LM from a checkpoint folder or a cached hub id with kvquant's FP8 KV cache.

    Like ``AutoModelForCausalLM.from_pretrained(path, quantization_config=KVQuantConfig())``,
    but also for KV-only checkpoints whose ``config.json`` names a quantizer
    transformers knows (compressed-tensors ``kv_cache_scheme``, Quark): their
    ``quantization_config`` is kept aside (discovery still reads it from the
    folder) so that transformers does not refuse the second config. A hub id is
    read from the local Hugging Face cache only (``local_files_only=True``):
    kvquant never downloads, and an id that is not cached is refused at once.

    Args:
        path: checkpoint folder, or a file inside it (``config.json``,
            ``model.safetensors``) for its folder, by the command line's rule;
            or a hub id in the local Hugging Face cache.
        quantization_config: kvquant settings (default: the ``KVQuantConfig`` a folder
            saved from a patched model holds, else ``KVQuantConfig()``); when given,
            it replaces a saved one.
        model_class: the transformers class to load with (default ``AutoModelForCausalLM``).
        **kwargs: passed to ``from_pretrained`` (``dtype``, ``device_map``,
            ``revision``, ``cache_dir``, ...); the config is read with the same
            ``revision``, ``cache_dir`` and ``subfolder``.

    Returns:
        The loaded, patched model.

    Raises:
        OptionTypeError: ``path`` or ``quantization_config`` of the wrong type.
        CheckpointError: ``path`` is neither a checkpoint folder nor a hub id in
            the local cache.
        UnsupportedModelError: the checkpoint also quantizes weights.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if not isinstance(path, (str, os.PathLike)):
        raise OptionTypeError(
            f"kvquant.from_pretrained: path is a {type(path).__name__}; expected a checkpoint "
            "folder (str or Path) or a hub id in the local Hugging Face cache."
        )
    if quantization_config is not None and not isinstance(quantization_config, KVQuantConfig):
        raise OptionTypeError(
            "kvquant.from_pretrained: quantization_config is a "
            f"{type(quantization_config).__name__}; expected a kvquant.KVQuantConfig (or None)."
        )
    cls = model_class or AutoModelForCausalLM
    qc = quantization_config
    path = folder_named_by(path)  # config.json or a shard names its folder, at every door
    locate_checkpoint(path, revision=kwargs.get("revision"), cache_dir=kwargs.get("cache_dir"))
    if not os.path.lexists(str(path)):  # a hub id, found in the local cache: never download
        kwargs["local_files_only"] = True
    hub = {k: kwargs[k] for k in (*_HUB_KWARGS, "local_files_only") if k in kwargs}
    config = kwargs.pop("config", None)
    if config is None:
        config = AutoConfig.from_pretrained(str(path), **hub)
        # config attributes among the keywords (num_hidden_layers=1 for a draft model, ...)
        # override config.json, as transformers' from_pretrained applies them
        overrides = {
            k: kwargs.pop(k) for k in list(kwargs) if k not in _MODEL_DTYPE and hasattr(config, k)
        }
        if overrides:
            config = AutoConfig.from_pretrained(str(path), **hub, **overrides)
    _drop_leftover_text_config(config)
    producer_cfg = getattr(config, "quantization_config", None)
    if producer_cfg is not None:
        as_dict = producer_cfg if isinstance(producer_cfg, dict) else producer_cfg.to_dict()
        producer = config_producer(as_dict)
        _check_kv_only(producer, as_dict, path)
        if producer is None or not producer.kvquant_config or quantization_config is not None:
            # a producer's config is kept aside (discovery reads it from the folder); a saved
            # kvquant config gives way to the one passed (transformers would keep the saved one)
            del config.quantization_config
    if getattr(config, "quantization_config", None) is None and qc is None:
        qc = KVQuantConfig()
    token = SET_ASIDE.set(True)  # a producer config kept aside: transformers does not warn
    try:
        return cls.from_pretrained(str(path), config=config, quantization_config=qc, **kwargs)
    finally:
        SET_ASIDE.reset(token)


def _drop_leftover_text_config(config: Any) -> None:
    """Drop a ``text_config`` dict that a plain config class does not use (some exports leave one).

    transformers reads such a model's geometry from the top level, but its
    ``get_text_config()`` returns the dict and building a causal LM fails;
    ``kvquant doctor`` reports it (``leftover-text-config``).
    """
    text = getattr(config, "text_config", None)
    if isinstance(text, dict) and "text_config" not in (getattr(config, "sub_configs", None) or {}):
        _logger.warning(
            "kvquant.from_pretrained: config.json has a text_config that model_type %r does not "
            "use; it is ignored (transformers reads the geometry from the top level). Fix: "
            "delete text_config from config.json.",
            getattr(config, "model_type", None),
        )
        del config.text_config


def _check_kv_only(producer: Producer | None, qcfg: dict[str, Any], path: str | Path) -> None:
    """Refuse a producer config that also quantizes the weights (kvquant loads KV scales only)."""
    if producer is not None and producer.config_quantizes_weights(qcfg):
        method = str(qcfg.get("quant_method", "")).lower()
        raise UnsupportedModelError(
            f"{path}: its {method} quantization_config also quantizes the weights; kvquant loads "
            "KV-cache scales only and cannot load quantized weights. Fix: use a KV-only "
            "checkpoint (bf16/fp16 weights plus FP8 KV scales)."
        )


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """Hide transformers' progress bars and warnings while a command loads a model.

    ``kvquant demo`` and ``kvquant calibrate`` print their own story; transformers'
    "Loading weights" bars and its report of UNEXPECTED keys (the KV-scale tensors a
    model has no parameter for) would interleave with it. Errors still raise. The
    previous verbosity and progress-bar setting are restored on exit.
    """
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()

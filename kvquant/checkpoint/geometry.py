"""A checkpoint's attention geometry from its ``config.json`` (``text_config`` where transformers reads it).

Every field is bounded; per-layer overrides (``per_layer_config``, Gemma 4's
full-attention layers) are read the way transformers reads them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from kvquant.errors import CheckpointError
from kvquant.types import LayerGeometry

__all__ = [
    "MAX_HEADS",
    "MAX_HEAD_DIM",
    "MAX_LAYERS",
    "language_config",
    "leftover_text_config",
    "read_geometry",
]

MAX_LAYERS = 4096
"""Most decoder layers a config may declare (the largest released models have a few hundred)."""

MAX_HEADS = 4096
"""Most attention heads (query or KV) a config may declare."""

MAX_HEAD_DIM = 4096
"""Largest ``head_dim`` a config may declare."""


def _positive_int(cfg: Mapping[str, Any], key: str, where: str, bound: int) -> int | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= bound:
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:40]}..."
        raise CheckpointError(
            f"{where}: {key} is {shown}, expected an integer from 1 to {bound}. "
            "Fix: correct config.json (use the config the weights were saved with)."
        )
    return value


def read_geometry(config: Mapping[str, Any], where: str = "config.json") -> LayerGeometry:
    """Read the attention geometry from a transformers config dict.

    Multimodal configs keep the language model's fields under ``text_config``;
    those are used where transformers uses them (:func:`language_config`).

    Args:
        config: the parsed ``config.json``.
        where: how to name the config in error messages.

    Returns:
        The model's :class:`LayerGeometry`.

    Raises:
        CheckpointError: a required field is missing or not a positive integer.
    """
    if language_config(config) is not config:
        config, where = config["text_config"], f"{where} text_config"
    layers = _positive_int(config, "num_hidden_layers", where, MAX_LAYERS)
    heads = _positive_int(config, "num_attention_heads", where, MAX_HEADS)
    if layers is None or heads is None:
        missing = [k for k in ("num_hidden_layers", "num_attention_heads") if config.get(k) is None]
        raise CheckpointError(
            f"{where} has no {' / '.join(missing)}; kvquant needs the decoder's layer and head "
            "counts. Fix: point at a transformers decoder checkpoint (a folder whose config.json "
            "has num_hidden_layers and num_attention_heads)."
        )
    kv_heads = _positive_int(config, "num_key_value_heads", where, MAX_HEADS) or heads
    head_dim = _positive_int(config, "head_dim", where, MAX_HEAD_DIM)
    hidden = _positive_int(config, "hidden_size", where, MAX_HEADS * MAX_HEAD_DIM)
    if head_dim is None:
        if hidden is None:
            raise CheckpointError(
                f"{where} has neither head_dim nor hidden_size. Fix: add head_dim to config.json."
            )
        head_dim = hidden // heads
        if not 0 < head_dim <= MAX_HEAD_DIM:
            raise CheckpointError(
                f"{where}: hidden_size={hidden} / num_attention_heads={heads} gives head_dim "
                f"{head_dim}, expected 1 to {MAX_HEAD_DIM}. Fix: add the right head_dim to "
                "config.json."
            )
    if heads % kv_heads != 0:
        raise CheckpointError(
            f"{where}: num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={kv_heads}. Fix: correct config.json."
        )
    overrides = _layer_overrides(config, layers, where)
    if not overrides:
        return LayerGeometry(
            num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim
        )
    kv_per_layer = [kv_heads] * layers
    dims = [head_dim] * layers
    for layer, fields in overrides.items():
        lwhere = f"{where} layer {layer}"
        kv_per_layer[layer] = _positive_int(fields, "num_key_value_heads", lwhere, MAX_HEADS) or (
            kv_heads
        )
        dims[layer] = _positive_int(fields, "head_dim", lwhere, MAX_HEAD_DIM) or head_dim
        if heads % kv_per_layer[layer]:
            raise CheckpointError(
                f"{lwhere}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv_per_layer[layer]}. Fix: correct config.json."
            )
    return LayerGeometry.from_layers(heads, kv_per_layer, dims)


def language_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The part of a config transformers builds the language model from: ``config`` or its ``text_config``.

    A composite config class (Llava, Gemma 3, Qwen2-VL, ...: transformers
    declares a ``text_config`` sub-config for its ``model_type``) reads the
    language model from ``text_config`` when the file has one; a plain one
    (Llama, Qwen2, ...) reads the top level and ignores a leftover
    ``text_config``, as some exports write (:func:`leftover_text_config`).
    """
    text = config.get("text_config")
    if not isinstance(text, Mapping) or "num_hidden_layers" not in text:
        return config
    return config if leftover_text_config(config) else text


def leftover_text_config(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` holds a ``text_config`` its ``model_type`` does not use.

    Only a config whose top level carries the decoder's geometry can be plain;
    for those, transformers' config class for ``model_type`` is asked whether
    it has a ``text_config`` sub-config (an unknown, e.g. remote-code, type is
    taken as composite). transformers 5.17 to 5.24 cannot build a causal LM
    from a plain config with a leftover ``text_config``: ``get_text_config()``
    returns the raw dict.
    """
    if not isinstance(config.get("text_config"), Mapping):
        return False
    if config.get("num_hidden_layers") is None or config.get("num_attention_heads") is None:
        return False
    model_type = config.get("model_type")
    return isinstance(model_type, str) and not _composite_model_type(model_type)


@functools.lru_cache(maxsize=64)
def _composite_model_type(model_type: str) -> bool:
    """Whether transformers' config class for ``model_type`` has a ``text_config`` sub-config.

    The one question the checkpoint tier asks transformers (a dependency of
    kvquant), imported here only for a config that has both a top-level
    geometry and a ``text_config``.
    """
    try:
        from transformers import CONFIG_MAPPING

        cls = CONFIG_MAPPING[model_type]
    except Exception:  # an unknown (remote-code) model type, or transformers unusable
        return True
    return "text_config" in (getattr(cls, "sub_configs", None) or {})


_GEMMA4_DEFAULT_GLOBAL_HEAD_DIM = 512
"""transformers' Gemma 4 default ``global_head_dim`` (full-attention layers) when config.json has none."""


def _layer_overrides(config: Mapping[str, Any], layers: int, where: str) -> dict[int, Any]:
    """Per-layer ``head_dim`` / ``num_key_value_heads`` overrides of a config, by layer index.

    Two spellings: transformers' generic ``per_layer_config`` (``{"3": {"head_dim": 512}}``,
    what a heterogeneous config saves), and Gemma 4's ``global_head_dim`` /
    ``num_global_key_value_heads`` for its ``full_attention`` layers (its hub
    configs; the KV-head override only with ``attention_k_eq_v``, as transformers reads it).

    Raises:
        CheckpointError: a malformed ``per_layer_config`` or ``layer_types``.
    """
    per_layer = config.get("per_layer_config")
    if per_layer is not None:
        if not isinstance(per_layer, Mapping) or len(per_layer) > layers:
            raise CheckpointError(
                f"{where}: per_layer_config is not a mapping of at most {layers} layer indices "
                "to attribute overrides. Fix: correct config.json."
            )
        out: dict[int, Any] = {}
        for key, fields in per_layer.items():
            index = int(key) if isinstance(key, str) and key.isdigit() else key
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < layers:
                raise CheckpointError(
                    f"{where}: per_layer_config has key {str(key)[:40]!r}; expected a layer index "
                    f"0-{layers - 1}. Fix: correct config.json."
                )
            if not isinstance(fields, Mapping):
                raise CheckpointError(
                    f"{where}: per_layer_config[{index}] is not a mapping of attribute "
                    "overrides. Fix: correct config.json."
                )
            out[index] = fields
        return out
    if not str(config.get("model_type", "")).startswith("gemma4"):
        return {}
    types = config.get("layer_types")
    if types is None:  # transformers' default pattern: every 6th layer is full
        types = ["full_attention" if (i + 1) % 6 == 0 else "sliding" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise CheckpointError(
            f"{where}: layer_types is not a list of {layers} layer types. Fix: correct config.json."
        )
    types = [*types[:-1], "full_attention"]  # transformers forces the last layer to full
    full: dict[str, Any] = {
        "head_dim": config.get("global_head_dim", _GEMMA4_DEFAULT_GLOBAL_HEAD_DIM)
    }
    if config.get("attention_k_eq_v") and config.get("num_global_key_value_heads") is not None:
        full["num_key_value_heads"] = config.get("num_global_key_value_heads")
    return {i: full for i, t in enumerate(types) if t == "full_attention"}

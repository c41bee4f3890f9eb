"""Checkpoint discovery: find the KV scales a checkpoint carries, without loading its weights.

Discovery reads ``config.json`` (and ``hf_quant_config.json`` when present), the
safetensors headers of every shard, and then loads **only** the tensors whose
names are KV scales. It maps every producer's naming onto :class:`RawScale`
records (layer, ``"k"`` / ``"v"`` / ``"kv"``, convention, flags) and collects
checkpoint-level :class:`Finding` s (producer, scheme, FP8 weights, zero points,
...). It never raises for scale *contents*: judging values and shapes is the
registry's job. It raises :class:`~kvquant.errors.CheckpointError` only when the
path is not a readable checkpoint.

Producers recognised (see ``docs`` / the checkpoint-conventions note):

=====================  ==========================================  ==========================
convention             tensor names (per layer ``N``)              decided from
=====================  ==========================================  ==========================
compressed-tensors     ``layers.N.self_attn.k_scale`` / ``v_scale``  ``quant_method``, names
modelopt               ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale``  ``quant_method``, ``hf_quant_config.json``, names
quark                  ``self_attn.k_proj.output_scale`` / ``v_proj``  ``quant_method`` (also ``self_attn.k_scale`` in Quark's fp8 export)
legacy-kv_scale        ``layers.N.self_attn.kv_scale``             names
tensorrt-llm           ``layers.N.attention.kv_cache_scaling_factor``  names
kvquant                ``self_attn.k_scale`` / ``v_scale``         ``quant_method: "kvquant"``
=====================  ==========================================  ==========================

kvquant's ``k-transform`` format adds ``layers.N.self_attn.k_offset`` tensors and
``kvquant_kv_transform.json`` (:mod:`kvquant.checkpoint.producers`); discovery
reads both into :attr:`DiscoveredCheckpoint.k_transform` and checks the file
(entries, types, bounds, the geometry it was calibrated for). Offsets without
the file, or the file without offsets, are error findings.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvquant.checkpoint.files import (
    TensorInfo,
    check_path_argument,
    locate_checkpoint,
    read_json,
    read_safetensors_header,
    scan_folder,
    select_shards,
)
from kvquant.checkpoint.findings import Finding
from kvquant.checkpoint.producers import (
    K_OFFSET_SUFFIX,
    KV_TRANSFORM_FILE,
    KV_TRANSFORM_FORMAT,
    KV_TRANSFORM_KEYS,
    KV_TRANSFORM_VERSION,
    NAMINGS,
)
from kvquant.errors import CheckpointError
from kvquant.types import (
    MAX_FIRST_TOKENS,
    ROTATIONS,
    KTransform,
    LayerGeometry,
    RawKTransform,
    RawOffset,
    RawScale,
    ScaleKind,
)

__all__ = [
    "MAX_HEADS",
    "MAX_HEAD_DIM",
    "MAX_LAYERS",
    "MAX_SCALE_ELEMENTS",
    "DiscoveredCheckpoint",
    "Finding",
    "TensorInfo",
    "discover_scales",
    "k_transform_from_mapping",
    "language_config",
    "leftover_text_config",
    "match_scale_name",
    "parse_kv_transform",
    "raw_scales_from_mapping",
    "raw_scales_from_state_dict",
    "read_geometry",
    "scale_tensor_infos",
]

MAX_LAYERS = 4096
"""Most decoder layers a config may declare (the largest released models have a few hundred)."""

MAX_HEADS = 4096
"""Most attention heads (query or KV) a config may declare."""

MAX_HEAD_DIM = 4096
"""Largest ``head_dim`` a config may declare."""

MAX_SCALE_ELEMENTS = 1 << 20
"""Most elements a KV-scale tensor may hold to be loaded (per-channel ``[Hkv, D]`` is far below)."""

# Name patterns. ``prefix`` is whatever precedes ``layers.N`` (``model.``,
# ``model.language_model.``, ``transformer.``, ...).
_LAYER = r"(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\."
_PATTERNS: tuple[tuple[re.Pattern[str], str, ScaleKind], ...] = tuple(
    # (pattern, naming family, kind), from the one producer table
    (re.compile(_LAYER + re.escape(suffix) + "$"), naming.family, kind)
    for naming in NAMINGS.values()
    for kind, suffix in naming.suffixes.items()
)
# Tensors that look like scales but are not KV scales: skipped on purpose.
_NOT_KV = re.compile(
    r"(?:\.q_scale|\.q_proj\.output_scale|\.prob_output_scale|\.weight_scale|\.input_scale"
    r"|\.weight_scale_2|\.output_scale)$"
)
_ZERO_POINT = re.compile(
    _LAYER + r"self_attn\.(?:(?P<kind>[kv])_zero_point|(?P<kind2>[kv])_proj\.output_zero_point)$"
)
_K_OFFSET = re.compile(_LAYER + re.escape(K_OFFSET_SUFFIX) + "$")
_AFFINE_BIAS = re.compile(_LAYER + r"self_attn\.(?P<kind>[kv])_proj\.(?P=kind)_bias$")

_FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"})


@dataclass(frozen=True)
class DiscoveredCheckpoint:
    """Everything discovery learnt about a checkpoint.

    Attributes:
        path: the checkpoint folder.
        geometry: attention geometry from ``config.json`` (``text_config`` for
            multimodal configs).
        producer: the producer convention decided for the checkpoint
            (``"compressed-tensors"``, ``"modelopt"``, ``"quark"``,
            ``"legacy-kv_scale"``, ``"tensorrt-llm"``, ``"kvquant"``, or
            ``"none"`` when there are no KV scales and no KV config).
        scales: the KV scales found, sorted by (layer, kind); tensors as stored.
        findings: checkpoint-level notes, warnings and errors.
        config: the parsed ``config.json``.
        quantization_config: ``config.json``'s ``quantization_config`` (or ``None``).
        hf_quant_config: the parsed ``hf_quant_config.json`` (or ``None``).
        files: the safetensors shard files read.
        num_tensors: tensors listed in the headers.
        weight_dtypes: header dtype -> count over the non-scale tensors.
        kv_scheme: the KV scheme as declared in the config, normalised to a flat
            dict (keys vary by producer), or ``None``.
        k_transform: kvquant's ``k-transform`` settings and ``k_offset``
            tensors (as stored) when the folder has both, else ``None``.
    """

    path: Path
    geometry: LayerGeometry
    producer: str
    scales: tuple[RawScale, ...]
    findings: tuple[Finding, ...]
    config: dict[str, Any]
    quantization_config: dict[str, Any] | None
    hf_quant_config: dict[str, Any] | None
    files: tuple[Path, ...]
    num_tensors: int
    weight_dtypes: dict[str, int] = field(default_factory=dict)
    kv_scheme: dict[str, Any] | None = None
    k_transform: RawKTransform | None = None

    @property
    def has_errors(self) -> bool:
        """Whether any checkpoint-level finding is an error."""
        return any(f.severity == "error" for f in self.findings)


# ---------------------------------------------------------------------------
# config


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


# ---------------------------------------------------------------------------
# safetensors


def _load_tensors(names_by_file: Mapping[str, list[str]]) -> dict[str, torch.Tensor]:
    """Load the named tensors only (never the rest of a shard)."""
    import safetensors  # local: keep the module import light

    out: dict[str, torch.Tensor] = {}
    for file, names in names_by_file.items():
        try:
            with safetensors.safe_open(file, framework="pt", device="cpu") as fh:
                for name in names:
                    out[name] = fh.get_tensor(name)
        except (safetensors.SafetensorError, OSError, ValueError, TypeError, RuntimeError) as exc:
            raise CheckpointError(
                f"{file}: could not read the scale tensors {names[:4]}"
                f"{' ...' if len(names) > 4 else ''}: {exc}. Fix: re-export the shard."
            ) from exc
    return out


# ---------------------------------------------------------------------------
# naming


def match_scale_name(name: str) -> tuple[int, ScaleKind, str] | None:
    """Match a tensor name against the known KV-scale namings.

    Args:
        name: a tensor name, e.g. ``model.layers.3.self_attn.k_proj.k_scale``.

    Returns:
        ``(layer, kind, family)`` where family is one of ``"self_attn"``,
        ``"modelopt"``, ``"output_scale"``, ``"legacy-kv_scale"``,
        ``"tensorrt-llm"``; or ``None`` when the name is not a KV scale.
    """
    for pattern, family, kind in _PATTERNS:
        m = pattern.match(name)
        if m:
            return int(m.group("layer")), kind, family
    return None


def _producer_from_config(
    qcfg: Mapping[str, Any] | None, hf_quant: Mapping[str, Any] | None
) -> str | None:
    method = str(qcfg.get("quant_method", "")).lower() if qcfg else ""
    if method in ("compressed-tensors", "compressed_tensors"):
        return "compressed-tensors"
    if method == "modelopt":
        return "modelopt"
    if method == "quark":
        return "quark"
    if method == "kvquant":
        return "kvquant"
    if hf_quant:
        producer = hf_quant.get("producer")
        if isinstance(producer, Mapping) and str(producer.get("name", "")).lower() == "modelopt":
            return "modelopt"
        if "quantization" in hf_quant:
            return "modelopt"
    return None


def _quark_post_rope(qcfg: Mapping[str, Any] | None) -> bool:
    if not qcfg:
        return False
    value = qcfg.get("kv_cache_post_rope")
    if value is None and isinstance(qcfg.get("export"), Mapping):
        value = qcfg["export"].get("kv_cache_post_rope")
    return bool(value)


def _kv_scheme(
    producer: str, qcfg: Mapping[str, Any] | None, hf_quant: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """Flatten the producer's declared KV scheme into one dict."""
    if producer in ("compressed-tensors", "modelopt", "kvquant") and qcfg:
        scheme = qcfg.get("kv_cache_scheme")
        if isinstance(scheme, Mapping):
            out = dict(scheme)
            if producer == "modelopt" and hf_quant:
                quant = hf_quant.get("quantization", hf_quant)
                if isinstance(quant, Mapping) and "kv_cache_quant_algo" in quant:
                    out["kv_cache_quant_algo"] = quant.get("kv_cache_quant_algo")
            return out
    if producer == "modelopt" and hf_quant:
        quant = hf_quant.get("quantization", hf_quant)
        if isinstance(quant, Mapping) and "kv_cache_quant_algo" in quant:
            return {"kv_cache_quant_algo": quant.get("kv_cache_quant_algo")}
    if producer == "quark" and qcfg:
        kvc = qcfg.get("kv_cache_quant_config")
        if isinstance(kvc, Mapping) and kvc:
            first = next(iter(kvc.values()))
            out_t = first.get("output_tensors") if isinstance(first, Mapping) else None
            out = dict(out_t) if isinstance(out_t, Mapping) else {}
            out["keys"] = sorted(kvc)
            out["kv_cache_post_rope"] = _quark_post_rope(qcfg)
            return out
    return None


# ---------------------------------------------------------------------------
# findings about the declared scheme and the weights


def _scheme_findings(producer: str, scheme: Mapping[str, Any] | None) -> list[Finding]:
    found: list[Finding] = []
    if scheme is None:
        return found
    algo = scheme.get("kv_cache_quant_algo")
    if algo is not None and str(algo).upper() != "FP8":
        found.append(
            Finding(
                "error",
                "kv-scheme-unsupported",
                f"hf_quant_config.json declares kv_cache_quant_algo={algo!r}; kvquant serves FP8 "
                "(e4m3) KV caches only. Fix: export with kv_cache_quant_algo 'FP8', or load the "
                "model without kvquant.",
            )
        )
    bits = scheme.get("num_bits")
    qtype = scheme.get("type")
    dtype = scheme.get("dtype")
    if (
        (bits is not None and bits != 8)
        or (qtype is not None and str(qtype) != "float")
        or (dtype is not None and "fp8" not in str(dtype).lower())
    ):
        found.append(
            Finding(
                "error",
                "kv-scheme-unsupported",
                f"the {producer} KV scheme is num_bits={bits!r}, type={qtype!r}"
                f"{f', dtype={dtype!r}' if dtype is not None else ''}; kvquant serves 8-bit float "
                "(FP8 e4m3) KV caches only. Fix: export an FP8 KV scheme.",
            )
        )
    symmetric = scheme.get("symmetric")
    if symmetric is False:
        found.append(
            Finding(
                "error",
                "kv-scheme-asymmetric",
                f"the {producer} KV scheme is asymmetric (symmetric: false, zero points); kvquant's "
                "FP8 cache is symmetric (scale only). Fix: re-calibrate with symmetric: true.",
            )
        )
    if scheme.get("dynamic") is True:
        found.append(
            Finding(
                "info",
                "kv-scheme-dynamic",
                f"the {producer} KV scheme is dynamic: no stored KV scales are expected; kvquant "
                "computes scales as tokens are written (fp32-group, or as --missing-scales says).",
            )
        )
    strategy = scheme.get("strategy")
    if strategy is not None and str(strategy) not in ("tensor", "attn_head"):
        found.append(
            Finding(
                "error",
                "kv-scheme-unsupported",
                f"the {producer} KV scheme has strategy={strategy!r}; kvquant understands "
                "'tensor' (per-tensor) and 'attn_head' (per KV head). Fix: export one of those.",
            )
        )
    elif strategy is not None:
        found.append(
            Finding("info", "kv-scheme", f"{producer} kv_cache_scheme strategy={strategy!r}.")
        )
    qscheme = scheme.get("qscheme")
    if qscheme is not None and str(qscheme) != "per_tensor":
        found.append(
            Finding(
                "error",
                "kv-scheme-unsupported",
                f"the quark KV scheme has qscheme={qscheme!r}; kvquant understands per_tensor "
                "output scales. Fix: export per_tensor KV scales.",
            )
        )
    return found


def _weight_findings(
    producer: str,
    qcfg: Mapping[str, Any] | None,
    hf_quant: Mapping[str, Any] | None,
    weight_dtypes: Mapping[str, int],
) -> list[Finding]:
    fp8 = {d: n for d, n in weight_dtypes.items() if d in _FP8_DTYPES}
    quant_algo = None
    if qcfg:
        quant_algo = qcfg.get("quant_algo")
    if hf_quant:
        quant = hf_quant.get("quantization", hf_quant)
        if isinstance(quant, Mapping) and quant.get("quant_algo") is not None:
            quant_algo = quant.get("quant_algo")
    found: list[Finding] = []
    if producer == "modelopt" and (fp8 or str(quant_algo).upper().startswith("FP8")):
        found.append(
            Finding(
                "warning",
                "fp8-weights-modelopt",
                f"ModelOpt FP8 weights ({sum(fp8.values())} FP8 tensors, quant_algo={quant_algo!r}): "
                "transformers does not know quant_method 'modelopt'; plain from_pretrained upcasts "
                "the FP8 weights and never applies weight_scale, giving a silently broken model. "
                "Fix: dequantize the weights (weight * weight_scale) before loading, or serve the "
                "checkpoint with an engine that reads ModelOpt FP8 weights; the KV scales "
                "themselves are fine.",
            )
        )
    elif fp8 and not qcfg:
        found.append(
            Finding(
                "warning",
                "fp8-weights-no-config",
                f"{sum(fp8.values())} weight tensors are stored in FP8 but config.json has no "
                "quantization_config: transformers would upcast them without any weight scale. "
                "Fix: use the checkpoint's original config, or dequantize the weights first.",
            )
        )
    elif fp8:
        found.append(
            Finding(
                "info",
                "fp8-weights",
                f"{sum(fp8.values())} weight tensors are FP8 ({producer} weight quantization); "
                "loading them needs the producer's transformers integration.",
            )
        )
    return found


# ---------------------------------------------------------------------------
# main entry points


def _classify(
    infos: Mapping[str, TensorInfo], geometry: LayerGeometry
) -> tuple[
    list[tuple[str, int, ScaleKind, str]], list[tuple[str, int]], list[Finding], Counter[str]
]:
    """Split header names into KV scales, K offsets, rejected extras and weights."""
    matches: list[tuple[str, int, ScaleKind, str]] = []
    offsets: list[tuple[str, int]] = []
    findings: list[Finding] = []
    weight_dtypes: Counter[str] = Counter()
    zero_points: list[str] = []
    biases: list[str] = []
    for name, info in infos.items():
        hit = match_scale_name(name)
        if hit is not None:
            matches.append((name, *hit))
            continue
        offset = _K_OFFSET.match(name)
        if offset is not None:
            offsets.append((name, int(offset.group("layer"))))
            continue
        if _ZERO_POINT.match(name):
            zero_points.append(name)
            continue
        if _AFFINE_BIAS.match(name):
            biases.append(name)
            continue
        if _NOT_KV.search(name):
            continue
        weight_dtypes[info.dtype] += 1
    if zero_points:
        findings.append(
            Finding(
                "error",
                "kv-zero-points",
                f"{len(zero_points)} KV zero-point tensor(s) (e.g. {sorted(zero_points)[0]}): an "
                "asymmetric KV scheme, which kvquant's symmetric FP8 cache cannot represent. "
                "Fix: re-calibrate the KV cache with symmetric: true.",
            )
        )
    if biases:
        findings.append(
            Finding(
                "error",
                "kv-affine-bias",
                f"{len(biases)} KV bias tensor(s) (e.g. {sorted(biases)[0]}): an affine KV preset "
                "(ModelOpt *_AFFINE), which kvquant's scale-only FP8 cache cannot represent. "
                "Fix: export with kv_cache_quant_algo 'FP8'.",
            )
        )
    families = {m[3] for m in matches}
    if len(families) > 1:
        findings.append(
            Finding(
                "warning",
                "mixed-namings",
                f"KV scales use several namings ({', '.join(sorted(families))}); each is read "
                "under its own convention. Check the export: one producer should have written them.",
            )
        )
    out_of_range = sorted(
        {m[1] for m in matches if m[1] >= geometry.num_layers}
        | {layer for _, layer in offsets if layer >= geometry.num_layers}
    )
    if out_of_range:
        findings.append(
            Finding(
                "error",
                "scale-layer-out-of-range",
                f"KV scales or K offsets for layer(s) {out_of_range} but config.json has "
                f"{geometry.num_layers} layers. Fix: use the config that matches the weights.",
            )
        )
    return matches, offsets, findings, weight_dtypes


# ---------------------------------------------------------------------------
# kvquant's k-transform convention


def parse_kv_transform(
    data: Mapping[str, Any], where: str, geometry: LayerGeometry
) -> tuple[KTransform | None, list[Finding]]:
    """Check the contents of ``kvquant_kv_transform.json`` against the model's geometry.

    Args:
        data: the parsed JSON object.
        where: how to name the file in findings.
        geometry: the geometry from ``config.json``.

    Returns:
        ``(settings, findings)``; settings are ``None`` when an entry is wrong
        (an error finding says which).
    """
    found: list[Finding] = []

    def bad(message: str) -> None:
        found.append(Finding("error", "kv-transform-invalid", f"{where}: {message}"))

    def show(value: Any) -> str:
        text = repr(value)
        return text if len(text) <= 40 else f"{text[:40]}..."

    fix = "Fix: re-run kvquant calibrate, or correct the file."
    missing = [k for k in KV_TRANSFORM_KEYS if k not in data]
    unknown = sorted(str(k) for k in data if k not in KV_TRANSFORM_KEYS)
    if missing:
        bad(
            f"missing {', '.join(missing)}; expected the entries {', '.join(KV_TRANSFORM_KEYS)}. {fix}"
        )
    if unknown:
        found.append(
            Finding(
                "warning",
                "kv-transform-unknown-entry",
                f"{where}: unknown entries {unknown[:5]} ignored (written by a newer kvquant?).",
            )
        )
    if "format" in data and data["format"] != KV_TRANSFORM_FORMAT:
        bad(f"format is {show(data['format'])}; expected {KV_TRANSFORM_FORMAT!r}. {fix}")
    version = data.get("version")
    if "version" in data and (isinstance(version, bool) or version != KV_TRANSFORM_VERSION):
        bad(
            f"version is {show(version)}; this kvquant reads version {KV_TRANSFORM_VERSION}. "
            "Fix: upgrade kvquant, or re-run kvquant calibrate with this version."
        )
    rotation = data.get("rotation")
    if "rotation" in data and rotation not in ROTATIONS:
        bad(f"rotation is {show(rotation)}; expected 'hadamard' or null. {fix}")
    first = data.get("first_tokens")
    if "first_tokens" in data and (
        isinstance(first, bool) or not isinstance(first, int) or not 0 <= first <= MAX_FIRST_TOKENS
    ):
        bad(f"first_tokens is {show(first)}; expected an int from 0 to {MAX_FIRST_TOKENS}. {fix}")
    for key, want in (
        ("head_dim", geometry.head_dim),
        ("num_kv_heads", geometry.num_kv_heads),
        ("num_layers", geometry.num_layers),
    ):
        value = data.get(key)
        if key in data and (isinstance(value, bool) or value != want):
            bad(
                f"{key} is {show(value)} but config.json gives {want}: the K transform was "
                "calibrated for another model. Fix: calibrate it for this model."
            )
    if any(f.severity == "error" for f in found) or not isinstance(first, int):
        return None, found
    return KTransform(rotation=rotation, first_tokens=first), found


def _k_transform(
    root: Path,
    offsets: list[tuple[str, int]],
    tensors: Mapping[str, torch.Tensor],
    geometry: LayerGeometry,
) -> tuple[RawKTransform | None, list[Finding]]:
    """The folder's K transform: the settings file and the offset tensors, or the findings why not."""
    path = root / KV_TRANSFORM_FILE
    has_file = os.path.lexists(path)
    if not has_file and not offsets:
        return None, []
    if not has_file:
        return None, [
            Finding(
                "error",
                "k-offset-without-transform",
                f"{len(offsets)} K offset tensor(s) (e.g. {sorted(offsets)[0][0]}) but no "
                f"{KV_TRANSFORM_FILE}: without it the rotation and first tokens the offsets were "
                "calibrated with are unknown. Fix: copy the file kvquant calibrate wrote beside "
                "the weights, or re-run kvquant calibrate.",
            )
        ]
    data = read_json(path, KV_TRANSFORM_FILE)
    settings, found = parse_kv_transform(data, str(path), geometry)
    if not offsets:
        found.append(
            Finding(
                "error",
                "kv-transform-without-offsets",
                f"{path} declares the k-transform format but the checkpoint has no "
                "model.layers.N.self_attn.k_offset tensors. Fix: save the offsets kvquant "
                f"calibrate wrote with the weights, or delete {KV_TRANSFORM_FILE}.",
            )
        )
    if settings is None or not offsets:
        return None, found
    raws = tuple(
        RawOffset(layer, name, tensors[name])
        for name, layer in sorted(offsets, key=lambda o: (o[1], o[0]))
        if layer < geometry.num_layers and name in tensors
    )
    found.append(
        Finding(
            "info",
            "kv-transform",
            f"k-transform format ({KV_TRANSFORM_FILE}): rotation {settings.rotation or 'none'}, "
            f"first {settings.first_tokens} token(s) at full precision, {len(raws)} K offset "
            "tensor(s).",
        )
    )
    return RawKTransform(settings=settings, offsets=raws, source=str(path)), found


def k_transform_from_mapping(
    mapping: Mapping[str, Any], geometry: LayerGeometry, where: str = "scales"
) -> RawKTransform | None:
    """The K transform of an explicit ``scales=`` mapping, or None when it has none.

    The mapping holds ``model.layers.N.self_attn.k_offset`` tensors and, under
    the key ``"kvquant_kv_transform.json"``, the contents of that file as a dict.

    Raises:
        ScaleFormatError: offsets without the settings, settings without
            offsets, or settings that are wrong for ``geometry``.
    """
    from kvquant.errors import ScaleFormatError

    offsets = []
    for name in mapping:
        hit = _K_OFFSET.match(str(name))
        if hit is not None:
            offsets.append((str(name), int(hit.group("layer"))))
    settings_obj = mapping.get(KV_TRANSFORM_FILE)
    if settings_obj is None and not offsets:
        return None
    if not isinstance(settings_obj, Mapping):
        raise ScaleFormatError(
            f"{where} holds {len(offsets)} K offset tensor(s) (e.g. {sorted(offsets)[0][0] if offsets else '-'}) "
            f"but {'no' if settings_obj is None else 'a non-dict'} {KV_TRANSFORM_FILE!r} entry; "
            "expected the file's contents as a dict (rotation, first_tokens, ...). Fix: pass "
            "the checkpoint folder instead, or add the settings under that key."
        )
    settings, found = parse_kv_transform(settings_obj, f"{where}[{KV_TRANSFORM_FILE!r}]", geometry)
    errors = [f.message for f in found if f.severity == "error"]
    if not offsets:
        errors.append(
            f"{where} declares the k-transform format but holds no "
            "model.layers.N.self_attn.k_offset tensor. Fix: add the offsets."
        )
    if errors or settings is None:
        raise ScaleFormatError("; ".join(errors))
    raws = tuple(
        RawOffset(layer, name, mapping[name])
        for name, layer in sorted(offsets, key=lambda o: (o[1], o[0]))
    )
    return RawKTransform(settings=settings, offsets=raws, source=f"{where} (mapping)")


def _convention_for(family: str, producer_cfg: str | None) -> str:
    if family == "self_attn" and producer_cfg in ("quark", "kvquant", "compressed-tensors"):
        return producer_cfg
    if family == "output_scale" and producer_cfg == "compressed-tensors":
        return "compressed-tensors"  # pre-2024-08 compressed-tensors naming
    return NAMINGS[family].default_producer


def _build_raw_scales(
    matches: list[tuple[str, int, ScaleKind, str]],
    tensors: Mapping[str, torch.Tensor],
    producer_cfg: str | None,
    qcfg: Mapping[str, Any] | None,
    geometry: LayerGeometry,
) -> tuple[list[RawScale], list[Finding]]:
    findings: list[Finding] = []
    post_rope = _quark_post_rope(qcfg)
    raws: list[RawScale] = []
    seen: dict[tuple[int, str], str] = {}
    for name, layer, kind, family in sorted(matches, key=lambda m: (m[1], m[2], m[0])):
        if layer >= geometry.num_layers:
            continue
        convention = _convention_for(family, producer_cfg)
        pre_rope = False
        merged = False
        notes: list[str] = []
        if convention == "quark":
            if qcfg is None:
                notes.append(
                    "no quantization_config: assumed Quark's default (K calibrated pre-RoPE, "
                    "max(K, V) stored in both)"
                )
            pre_rope = not post_rope
            merged = not post_rope
            if family == "self_attn":
                merged = True
                notes.append("Quark fp8-mode export: both tensors hold max(K, V)")
        elif convention == "tensorrt-llm":
            notes.append(
                "TensorRT-LLM legacy kv_cache_scaling_factor: max(K, V), clamped >= 1.0 by ModelOpt"
            )
        elif convention == "legacy-kv_scale":
            notes.append("legacy single kv_scale: one scale serves K and V")
        elif family == "output_scale" and convention == "compressed-tensors":
            notes.append("pre-2024-08 compressed-tensors naming (k_proj.output_scale)")
        key = (layer, kind)
        if key in seen:
            findings.append(
                Finding(
                    "error",
                    "duplicate-scale",
                    f"layer {layer} has two {kind.upper()} scales: {seen[key]} and {name}. "
                    "Fix: keep one naming in the export.",
                )
            )
            continue
        seen[key] = name
        raws.append(
            RawScale(
                layer=layer,
                kind=kind,
                name=name,
                convention=convention,
                tensor=tensors[name],
                pre_rope=pre_rope if kind != "v" else False,
                merged_kv=merged,
                notes=tuple(notes),
            )
        )
    return raws, findings


def _quark_findings(raws: list[RawScale], qcfg: Mapping[str, Any] | None) -> list[Finding]:
    quark = [r for r in raws if r.convention == "quark"]
    if not quark:
        return []
    found: list[Finding] = []
    if _quark_post_rope(qcfg):
        found.append(
            Finding(
                "info",
                "quark-post-rope",
                "Quark export with kv_cache_post_rope: true: K calibrated after RoPE, K and V "
                "scales kept separate; used as is.",
            )
        )
    else:
        found.append(
            Finding(
                "info",
                "quark-pre-rope-merged",
                "Quark default export (kv_cache_post_rope: false): K was calibrated before RoPE "
                "and both tensors hold max(K, V). RoPE can raise a post-RoPE key component up to "
                "sqrt(2)x the pre-RoPE amax, so K may saturate at 448 unless the merge with V "
                "already covers it; the registry's policy decides (see per-layer notes).",
            )
        )
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for r in quark:
        by_layer.setdefault(r.layer, {})[r.kind] = r.tensor
    pairs = [d for d in by_layer.values() if "k" in d and "v" in d]
    if pairs:
        identical = all(
            d["k"].shape == d["v"].shape
            and bool(torch.equal(d["k"].to(torch.float64), d["v"].to(torch.float64)))
            for d in pairs
        )
        if not _quark_post_rope(qcfg) and not identical:
            found.append(
                Finding(
                    "warning",
                    "quark-merge-mismatch",
                    "the Quark config says K and V scales are merged, but some layers hold "
                    "different K and V values: treated as separate scales.",
                )
            )
    return found


def discover_scales(path: str | Path, *, revision: str | None = None) -> DiscoveredCheckpoint:
    """Discover the KV scales of a checkpoint folder, loading only the scale tensors.

    Reads ``config.json`` (geometry; ``text_config`` for multimodal configs),
    ``hf_quant_config.json`` when present, and the safetensors headers of the
    files transformers reads (``model.safetensors``, else the shards
    ``model.safetensors.index.json`` names; see
    :func:`kvquant.checkpoint.select_shards`), decides the producer from the
    config first and the tensor names second, and loads only the tensors whose
    names are KV scales. Values are not judged here. Every file is untrusted:
    see :mod:`kvquant.checkpoint.files` for the bounds.

    Args:
        path: a checkpoint folder (or its ``config.json``), or a hub id found
            in the local Hugging Face cache (nothing is downloaded).
        revision: the hub revision when ``path`` is a hub id.

    Returns:
        A :class:`DiscoveredCheckpoint` with the raw scales and checkpoint-level findings.

    Raises:
        CheckpointError: the path does not exist (and is not a cached hub
            model), is not a checkpoint (no ``config.json``, no safetensors
            weights), or a file is malformed, special or outside the folder.
        OptionTypeError: ``path`` is not a str or path.

    Example:
        >>> import tempfile
        >>> from kvquant.testing.checkpoints import write_checkpoint
        >>> with tempfile.TemporaryDirectory() as d:
        ...     ckpt = discover_scales(write_checkpoint(d, convention="modelopt", weights="none"))
        ...     print(ckpt.producer, [(s.layer, s.kind) for s in ckpt.scales])
        modelopt [(0, 'k'), (0, 'v'), (1, 'k'), (1, 'v')]
    """
    check_path_argument(path, "discover_scales: path")
    root = locate_checkpoint(path, revision=revision)
    config_path = root / "config.json"
    if not os.path.lexists(config_path):
        raise CheckpointError(
            f"{root} has no config.json, so it is not a transformers checkpoint. "
            "Fix: pass the folder written by save_pretrained (or snapshot_download)."
        )
    config = read_json(config_path, "config.json")
    geometry = read_geometry(config, str(config_path))
    qcfg_raw = config.get("quantization_config")
    language = language_config(config)
    if qcfg_raw is None and language is not config:
        qcfg_raw = language.get("quantization_config")
    qcfg: dict[str, Any] | None = dict(qcfg_raw) if isinstance(qcfg_raw, Mapping) else None
    hf_quant_path = root / "hf_quant_config.json"
    hf_quant = (
        read_json(hf_quant_path, "hf_quant_config.json") if os.path.lexists(hf_quant_path) else None
    )

    selection = select_shards(root, config)
    files = selection.files
    infos = selection.tensors
    producer_cfg = _producer_from_config(qcfg, hf_quant)
    from_transform_file = producer_cfg is None and os.path.lexists(root / KV_TRANSFORM_FILE)
    if from_transform_file:
        producer_cfg = "kvquant"
    matches, offsets, findings, weight_dtypes = _classify(infos, geometry)

    by_file: dict[str, list[str]] = {}
    oversized = [m for m in matches if math.prod(infos[m[0]].shape) > MAX_SCALE_ELEMENTS]
    if oversized:
        findings.append(
            Finding(
                "error",
                "scale-too-large",
                f"{len(oversized)} KV-scale tensor(s) (e.g. {oversized[0][0]}, shape "
                f"{infos[oversized[0][0]].shape}) hold more than {MAX_SCALE_ELEMENTS} elements; "
                "no KV-scale layout is that large, so they were not loaded. Fix: check the "
                "export (the tensor names may be wrong).",
            )
        )
        matches = [m for m in matches if m not in oversized]
    big_offsets = [o for o in offsets if math.prod(infos[o[0]].shape) > MAX_SCALE_ELEMENTS]
    if big_offsets:
        findings.append(
            Finding(
                "error",
                "scale-too-large",
                f"{len(big_offsets)} K offset tensor(s) (e.g. {big_offsets[0][0]}, shape "
                f"{infos[big_offsets[0][0]].shape}) hold more than {MAX_SCALE_ELEMENTS} elements; "
                "a K offset is [num_kv_heads, head_dim], so they were not loaded. Fix: check "
                "the export.",
            )
        )
        offsets = [o for o in offsets if o not in big_offsets]
    for name, layer, _kind, _family in matches:
        if layer < geometry.num_layers:
            by_file.setdefault(infos[name].file, []).append(name)
    for name, layer in offsets:
        if layer < geometry.num_layers:
            by_file.setdefault(infos[name].file, []).append(name)
    tensors = _load_tensors(by_file)
    raws, dup_findings = _build_raw_scales(matches, tensors, producer_cfg, qcfg, geometry)
    findings.extend(dup_findings)
    k_transform, transform_findings = _k_transform(root, offsets, tensors, geometry)
    findings.extend(transform_findings)

    if producer_cfg is not None:
        producer = producer_cfg
    elif raws:
        conventions = Counter(r.convention for r in raws)
        producer = conventions.most_common(1)[0][0]
    else:
        producer = "none"

    all_findings: list[Finding] = []
    method = qcfg.get("quant_method") if qcfg else None
    if producer_cfg is not None:
        source = (
            KV_TRANSFORM_FILE
            if from_transform_file
            else (f"quant_method {method!r}" if method else "hf_quant_config.json")
        )
        all_findings.append(Finding("info", "producer", f"{producer} (from {source})."))
    elif raws:
        all_findings.append(
            Finding(
                "info",
                "producer",
                f"{producer} (from tensor names; config.json has no quantization_config).",
            )
        )
    if qcfg is not None and method and producer_cfg is None:
        all_findings.append(
            Finding(
                "warning",
                "unknown-quant-method",
                f"config.json quant_method {method!r} is not a KV-cache producer kvquant knows; "
                "KV scales were matched by name only.",
            )
        )
    scheme = _kv_scheme(producer, qcfg, hf_quant)
    all_findings.extend(_scheme_findings(producer, scheme))
    if not raws:
        dynamic = bool(scheme and scheme.get("dynamic") is True)
        if not dynamic:
            all_findings.append(
                Finding(
                    "info" if producer == "none" else "warning",
                    "no-kv-scales",
                    "the checkpoint carries no KV scales"
                    + (
                        f" although its {producer} config declares a KV scheme"
                        if producer != "none"
                        else ""
                    )
                    + "; kvquant falls back to --missing-scales (default: dynamic fp32-group scales).",
                )
            )
    if leftover_text_config(config):
        all_findings.append(
            Finding(
                "warning",
                "leftover-text-config",
                f"config.json has a text_config that its model_type {config.get('model_type')!r} "
                "does not use: the geometry is read from the top level, as transformers reads "
                "it. transformers cannot build a causal LM from this file while the leftover is "
                "there (get_text_config() returns it); kvquant.from_pretrained drops it. Fix: "
                "delete text_config from config.json.",
            )
        )
    all_findings.extend(selection.findings)
    _, problems = scan_folder(root)
    if problems:
        all_findings.append(
            Finding(
                "warning",
                "uncopyable-file",
                f"{problems[0]} kvquant reads only the config, index and weight files, but "
                "kvquant export and calibrate copy the whole folder and refuse this one. Fix: "
                "replace it with a regular file (or a real folder), or remove it.",
            )
        )
    all_findings.extend(findings)
    all_findings.extend(_quark_findings(raws, qcfg))
    all_findings.extend(_weight_findings(producer, qcfg, hf_quant, weight_dtypes))
    if producer == "compressed-tensors" and qcfg is not None:
        fmt = qcfg.get("format")
        if qcfg.get("config_groups"):
            all_findings.append(
                Finding(
                    "info",
                    "ct-weight-quantization",
                    f"compressed-tensors also quantizes weights (format {fmt!r}): loading the "
                    "weights needs the compressed-tensors package.",
                )
            )

    return DiscoveredCheckpoint(
        path=root,
        geometry=geometry,
        producer=producer,
        scales=tuple(raws),
        findings=tuple(all_findings),
        config=config,
        quantization_config=qcfg,
        hf_quant_config=hf_quant,
        files=files,
        num_tensors=len(infos),
        weight_dtypes=dict(weight_dtypes),
        kv_scheme=scheme,
        k_transform=k_transform,
    )


def scale_tensor_infos(files: Iterable[str | Path]) -> dict[str, TensorInfo]:
    """Header facts (dtype, shape, file) of the KV-scale tensors in safetensors files; nothing is loaded.

    For code that must size buffers before the weights load (e.g. a transformers
    quantizer's ``_process_model_before_weight_loading(checkpoint_files=...)``).

    Args:
        files: safetensors files (shards) of one checkpoint.

    Returns:
        ``{tensor name: TensorInfo}`` for every name :func:`match_scale_name` accepts.

    Raises:
        CheckpointError: a file is missing or its header is unreadable.
    """
    out: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in read_safetensors_header(file).items():
            if match_scale_name(name) is not None:
                out[name] = info
    return out


def raw_scales_from_mapping(
    mapping: Mapping[str, Any], where: str = "scales", *, allow_none: bool = False
) -> list[RawScale]:
    """The raw KV scales of an explicit ``{tensor_name: tensor}`` mapping (``patch(scales=...)``).

    Unlike :func:`raw_scales_from_state_dict`, a mapping that names no KV scale
    kvquant recognises (a typo, an empty dict) is an error, not "no scales";
    unless ``allow_none`` (a dynamic scale format, which uses no stored scale).

    Args:
        mapping: tensor name -> tensor, producer names (other tensors are ignored).
        where: how to name the mapping in messages.
        allow_none: accept a mapping that names no KV scale.

    Returns:
        The raw scales, sorted by (layer, kind).

    Raises:
        OptionTypeError: a key is not a str.
        ScaleFormatError: a value is not a tensor, no name is a KV scale, or two
            names give one layer's K (or V) scale.
    """
    from kvquant.errors import OptionTypeError, ScaleFormatError

    for name, t in mapping.items():
        if not isinstance(name, str):
            raise OptionTypeError(
                f"{where} has the key {name!r} (a {type(name).__name__}); expected tensor names "
                "(str), e.g. 'model.layers.0.self_attn.k_scale'. Fix: pass {tensor_name: tensor}."
            )
        if name == KV_TRANSFORM_FILE:
            continue  # the k-transform settings (k_transform_from_mapping)
        if not isinstance(t, torch.Tensor):
            raise ScaleFormatError(
                f"{where}[{name!r}] is a {type(t).__name__}; expected a torch.Tensor. "
                "Fix: pass {tensor_name: tensor}."
            )
    raws = raw_scales_from_state_dict(
        {k: v for k, v in mapping.items() if k != KV_TRANSFORM_FILE}, strict=where
    )
    if not raws and not allow_none:
        names = sorted(str(n) for n in mapping)
        shown = f"{len(names)} name(s), e.g. {names[:3]}" if names else "an empty mapping"
        raise ScaleFormatError(
            f"{where} names no tensor kvquant recognises as a KV scale (got {shown}); expected "
            "producer names such as model.layers.0.self_attn.k_scale / v_scale, "
            "self_attn.k_proj.k_scale, self_attn.k_proj.output_scale or self_attn.kv_scale. "
            "Fix: correct the names, leave scales unset to read the model's own checkpoint, or "
            'pass scale_format="fp32-group" (dynamic scales, no stored ones) with scales={}.'
        )
    return raws


def raw_scales_from_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    *,
    producer: str | None = None,
    quantization_config: Mapping[str, Any] | None = None,
    strict: str = "",
) -> list[RawScale]:
    """Map an in-memory ``{tensor_name: tensor}`` mapping to raw KV scales.

    Same naming rules as :func:`discover_scales` (non-KV tensors are ignored),
    for scales that are already in memory (e.g. the HF quantizer after load).

    Args:
        state_dict: tensor name -> tensor (any shape/dtype, as stored).
        producer: the producer convention when known (``"quark"``, ...); else
            decided from ``quantization_config`` and then the names.
        quantization_config: the checkpoint's ``quantization_config`` dict, if any.

        strict: when not empty, how to name the mapping in an error: two
            tensors for one layer and kind (two namings, e.g. ``self_attn.k_scale``
            and ``self_attn.k_proj.k_scale``) then raise, as discovery refuses
            them in a checkpoint folder.

    Returns:
        The raw scales, sorted by (layer, kind). Unless ``strict``, duplicate
        (layer, kind) pairs keep the first name in sorted order.

    Raises:
        ScaleFormatError: ``strict`` and two tensors name one layer's K (or V) scale.
    """
    qcfg = dict(quantization_config) if quantization_config else None
    producer_cfg = producer or _producer_from_config(qcfg, None)
    matches = []
    for name in state_dict:
        hit = match_scale_name(name)
        if hit is not None:
            matches.append((name, *hit))
    big = LayerGeometry(num_layers=1 << 30, num_heads=1, num_kv_heads=1, head_dim=1)
    tensors = {name: state_dict[name] for name, *_ in matches}
    raws, findings = _build_raw_scales(matches, tensors, producer_cfg, qcfg, big)
    if strict:
        errors = [f.message for f in findings if f.severity == "error"]
        if errors:
            from kvquant.errors import ScaleFormatError

            raise ScaleFormatError(
                f"{strict}: {len(errors)} problem(s) with the KV scales: " + " ".join(errors)
            )
    return raws

"""NVIDIA ModelOpt's unified HF export: ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale``, ``()`` fp32.

Detected from ``quant_method`` or ``hf_quant_config.json``; its
``kv_cache_scheme`` has no ``strategy`` (per-tensor only).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvquant.checkpoint.findings import Finding
from kvquant.checkpoint.fp4_formats import Fp4Producer, kv_formats_per_layer
from kvquant.checkpoint.producers.base import Naming, Producer, ScaleShape

__all__ = [
    "ModelOpt",
    "modelopt_hf_quant_config",
    "modelopt_kv_cache_scheme",
    "modelopt_quantization_config",
]

_PRODUCER = {"name": "modelopt", "version": "0.47.0"}
"""The release whose exports were checked tensor by tensor."""


def modelopt_kv_cache_scheme() -> dict[str, Any]:
    """The ``kv_cache_scheme`` ModelOpt writes into ``quantization_config`` for FP8 KV.

    Returns:
        A new dict.
    """
    return {"dynamic": False, "num_bits": 8, "type": "float"}


def modelopt_quantization_config(
    producer: Any,
    *,
    ignore: Sequence[str] = ("lm_head",),
    fp8_weights: bool = False,
) -> dict[str, Any]:
    """ModelOpt's ``quantization_config`` (config.json) with FP8 KV scales.

    Args:
        producer: the ``producer`` entry (``{"name": "modelopt", "version": ...}``;
            a mapping is copied, anything else is stored as given).
        ignore: the ``ignore`` list.
        fp8_weights: also declare FP8 Linear weights and inputs (``quant_algo: FP8``).

    Returns:
        A new dict.
    """
    qcfg: dict[str, Any] = {
        "quant_method": "modelopt",
        "ignore": list(ignore),
        "producer": dict(producer) if isinstance(producer, Mapping) else producer,
        "kv_cache_scheme": modelopt_kv_cache_scheme(),
    }
    if fp8_weights:
        qcfg["quant_algo"] = "FP8"
        qcfg["config_groups"] = {
            "group_0": {
                "weights": {"num_bits": 8, "type": "float", "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": False},
                "targets": ["Linear"],
            }
        }
    return qcfg


def modelopt_hf_quant_config(
    producer: Mapping[str, Any],
    *,
    exclude_modules: Sequence[str] = ("lm_head",),
    fp8_weights: bool = False,
) -> dict[str, Any]:
    """ModelOpt's ``hf_quant_config.json`` with ``kv_cache_quant_algo: FP8``.

    Args:
        producer: the ``producer`` entry.
        exclude_modules: the ``exclude_modules`` list.
        fp8_weights: ``quant_algo: FP8`` (else ``None`` with empty ``quantized_layers``).

    Returns:
        A new dict.
    """
    quant: dict[str, Any] = {
        "quant_algo": "FP8" if fp8_weights else None,
        "kv_cache_quant_algo": "FP8",
        "exclude_modules": list(exclude_modules),
    }
    if not fp8_weights:
        quant["quantized_layers"] = {}
    return {"producer": dict(producer), "quantization": quant}


def _quantization(hf_quant: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The ``quantization`` section of ``hf_quant_config.json`` (or the file itself)."""
    if not hf_quant:
        return None
    quant = hf_quant.get("quantization", hf_quant)
    return quant if isinstance(quant, Mapping) else None


class ModelOpt(Producer):
    """NVIDIA ModelOpt (KV-only or FP8 weights + FP8 KV)."""

    name = "modelopt"
    names = Naming("modelopt", {"k": "self_attn.k_proj.k_scale", "v": "self_attn.v_proj.v_scale"})
    quant_methods = ("modelopt",)
    default_dtype = torch.float32
    per_tensor_shape = ScaleShape.SCALAR
    keeps_weights = True
    write_options = frozenset({"fp8_weights"})
    # NVFP4 KV: the FP8 names, fp32 () or [Hkv], holding the dequantization multiplier itself
    fp4 = Fp4Producer(name, "amax/(6*448)", (names.suffixes["k"],), (names.suffixes["v"],))

    def detect_side_config(self, hf_quant: Mapping[str, Any]) -> bool:
        producer = hf_quant.get("producer")
        if isinstance(producer, Mapping) and str(producer.get("name", "")).lower() == self.name:
            return True
        return "quantization" in hf_quant

    def kv_scheme(
        self, qcfg: Mapping[str, Any] | None, hf_quant: Mapping[str, Any] | None
    ) -> dict[str, Any] | None:
        quant = _quantization(hf_quant)
        algo = quant is not None and "kv_cache_quant_algo" in quant
        scheme = qcfg.get("kv_cache_scheme") if qcfg else None
        if isinstance(scheme, Mapping):
            out = dict(scheme)
            if algo and quant is not None:
                out["kv_cache_quant_algo"] = quant.get("kv_cache_quant_algo")
            return out
        if algo and quant is not None:
            return {"kv_cache_quant_algo": quant.get("kv_cache_quant_algo")}
        return None

    def kv_formats(
        self, qcfg: Mapping[str, Any] | None, hf_quant: Mapping[str, Any] | None, num_layers: int
    ) -> tuple[tuple[str, str], ...] | None:
        # hf_quant_config.json's quantization, else config.json's quantization_config (the
        # same keys), else its kv_cache_scheme string ("NVFP4"; a dict is the FP8 scheme)
        quant = _quantization(hf_quant)
        if quant is None or "kv_cache_quant_algo" not in quant:
            quant = qcfg if qcfg and "kv_cache_quant_algo" in qcfg else None
        if quant is None:
            scheme = qcfg.get("kv_cache_scheme") if qcfg else None
            if not isinstance(scheme, str):
                return None
            quant = {"kv_cache_quant_algo": scheme}
        algo = quant.get("kv_cache_quant_algo")
        if algo is None or str(algo).upper() == "FP8":
            return None
        return kv_formats_per_layer(quant, num_layers)

    def weight_finding(self, fp8_tensors: int, quant_algo: Any) -> Finding | None:
        if not fp8_tensors and not str(quant_algo).upper().startswith("FP8"):
            return None
        return Finding(
            "warning",
            "fp8-weights-modelopt",
            f"ModelOpt FP8 weights ({fp8_tensors} FP8 tensors, quant_algo={quant_algo!r}): "
            "transformers does not know quant_method 'modelopt'; plain from_pretrained upcasts "
            "the FP8 weights and never applies weight_scale, giving a silently broken model. "
            "Fix: dequantize the weights (weight * weight_scale) before loading, or serve the "
            "checkpoint with an engine that reads ModelOpt FP8 weights; the KV scales "
            "themselves are fine.",
        )

    def weight_quantization(
        self, qcfg: Mapping[str, Any], hf_quant: Mapping[str, Any] | None
    ) -> str | None:
        algo = qcfg.get("quant_algo")
        quant = _quantization(hf_quant)
        if quant is not None and quant.get("quant_algo") is not None:
            algo = quant.get("quant_algo")
        return None if algo is None else f"ModelOpt quant_algo {algo!r}"

    def config_quantizes_weights(self, qcfg: Mapping[str, Any]) -> bool:
        return qcfg.get("quant_algo") not in (None, "", "null")

    def configs(
        self,
        *,
        granularity: str = "per-tensor",
        fp8_weights: bool = False,
        post_rope: bool = False,
        scale_dtype: torch.dtype | None = None,
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        return (
            modelopt_quantization_config(_PRODUCER, fp8_weights=fp8_weights),
            modelopt_hf_quant_config(_PRODUCER, fp8_weights=fp8_weights),
        )

    def export_configs(
        self,
        granularity: str,
        qcfg: Mapping[str, Any] | None,
        hf_quant: Mapping[str, Any] | None,
        *,
        same_producer: bool,
        weights: str | None,
        observer: str = "minmax",
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        # weights quantized by ModelOpt: keep the weight config, declare FP8 KV (a checkpoint
        # declaring ModelOpt in hf_quant_config.json only keeps no config entry)
        out = dict(qcfg or {})
        if out:
            out["kv_cache_scheme"] = modelopt_kv_cache_scheme()
        side = json.loads(json.dumps(hf_quant or {}))
        if not side:
            side = {
                "producer": {"name": self.name, "version": "unknown"},
                "quantization": {"quant_algo": out.get("quant_algo", "FP8")},
            }
        side.setdefault("quantization", {})["kv_cache_quant_algo"] = "FP8"
        return out or None, side

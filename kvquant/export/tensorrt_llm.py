"""TensorRT-LLM: ModelOpt's ``k_proj.k_scale`` / ``v_proj.v_scale`` fp32 ``()``, beside FP8 weights.

Its HF loader needs ``hf_quant_config.json`` to name a weight ``quant_algo``,
so only a ModelOpt checkpoint with quantized weights can be exported for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from kvquant.checkpoint.discovery import DiscoveredCheckpoint
from kvquant.checkpoint.producers import ModelOpt, Producer, ScaleShape
from kvquant.errors import ExportError
from kvquant.export.base import Engine, Rule

__all__ = ["TensorRTLLM"]


class TensorRTLLM(Engine):
    """TensorRT-LLM's FP8 linear methods, which read the KV scales of k_proj / v_proj."""

    name = "tensorrt-llm"
    rules: ClassVar[Mapping[str, Rule]] = {
        "per-tensor": Rule(
            ScaleShape.SCALAR,
            "TensorRT-LLM's FP8 linear method reads k_proj.k_scale / v_proj.v_scale as "
            "single elements into fp32 kv_scales",
        ),
    }

    def target(
        self,
        found: DiscoveredCheckpoint,
        producer: Producer | None,
        granularity: str,
        weights: str | None,
    ) -> Producer:
        if isinstance(producer, ModelOpt) and weights is not None:
            return producer
        raise ExportError(
            f"{found.path}: a {found.producer} checkpoint "
            + (f"with {weights}" if weights else "with unquantized weights")
            + " cannot be exported for TensorRT-LLM. Its HF loader requires "
            "hf_quant_config.json to name a weight quant_algo ('Pre-quantized checkpoint must "
            "have quant_algo', tensorrt_llm/llmapi/llm_utils.py) and reads k_scale / v_scale "
            "only inside its FP8 linear methods, under k_proj / v_proj (ModelOpt naming). "
            "Fix: quantize the weights with ModelOpt (quant_algo FP8, kv_cache_quant_algo FP8) "
            "and export that checkpoint, or serve this one with --engine vllm or sglang."
        )

"""TensorRT-LLM's legacy engine checkpoint: ``attention.kv_cache_scaling_factor``, ``[1]`` fp32.

One scale per layer holds ``max(K, V)``, clamped to at least 1.0 by ModelOpt.
kvquant reads it (and refuses to export it: it is not a Hugging Face checkpoint).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvquant.checkpoint.fp4_formats import Fp4Producer
from kvquant.checkpoint.producers.base import Naming, Producer, ScaleShape

__all__ = ["TensorRTLLM"]


class TensorRTLLM(Producer):
    """TensorRT-LLM's legacy checkpoint (read only; kvquant writes it for tests alone)."""

    name = "tensorrt-llm"
    names = Naming("tensorrt-llm", {"kv": "attention.kv_cache_scaling_factor"})
    default_dtype = torch.float32
    per_tensor_shape = ScaleShape.ONE
    writable = False
    hugging_face = False
    # NVFP4 KV under ModelOpt's names, read as amax/448 (the number its loader says it
    # requests): not confirmed, docs/dev/fp4-formats.md
    fp4 = Fp4Producer(
        name,
        "amax/448",
        ("self_attn.k_proj.k_scale",),
        ("self_attn.v_proj.v_scale",),
        confirmed=False,
    )

    def scale_facts(
        self, family: str, qcfg: Mapping[str, Any] | None
    ) -> tuple[bool, bool, tuple[str, ...]]:
        note = "TensorRT-LLM legacy kv_cache_scaling_factor: max(K, V), clamped >= 1.0 by ModelOpt"
        return False, False, (note,)

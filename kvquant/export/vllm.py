"""vLLM: ``self_attn.k_scale`` / ``v_scale`` fp32, ``(1,)`` per tensor or ``(Hkv,1,1)`` per head."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from kvquant.checkpoint.producers import ScaleShape
from kvquant.export.base import Engine, Rule

__all__ = ["VLLM"]


class VLLM(Engine):
    """vLLM's compressed-tensors (and ModelOpt) KV-scale loaders."""

    name = "vllm"
    rules: ClassVar[Mapping[str, Rule]] = {
        "per-tensor": Rule(
            ScaleShape.ONE,
            "vLLM loads each scale into a one-element fp32 parameter (numel-1 tensors are "
            "filled, so () loads too) and keeps a Python float per layer",
        ),
        "per-head": Rule(
            ScaleShape.PER_HEAD,
            "vLLM's compressed-tensors attn_head path: one scale per KV head; vLLM documents "
            "per-head KV scales for the FlashAttention backend only (other backends use the "
            "max over heads)",
        ),
    }

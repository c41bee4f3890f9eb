"""SGLang: ``self_attn.k_scale`` / ``v_scale`` fp32 ``()``, per tensor only."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from kvquant.checkpoint.producers import ScaleShape
from kvquant.export.base import Engine, Rule

__all__ = ["SGLang"]


class SGLang(Engine):
    """SGLang's 0-dim fp32 KV-scale parameters."""

    name = "sglang"
    rules: ClassVar[Mapping[str, Rule]] = {
        "per-tensor": Rule(
            ScaleShape.SCALAR,
            "SGLang keeps 0-dim fp32 k_scale / v_scale parameters and raises 'Only support "
            "per-tensor scaling factor for fp8 KV cache' for anything else",
        ),
    }

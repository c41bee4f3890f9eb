"""The legacy single ``self_attn.kv_scale``: one ``()`` fp32 scale serves K and V.

vLLM remaps it with a deprecation warning; TGI falls back to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvquant.checkpoint.producers.base import Naming, Producer, ScaleShape

__all__ = ["LegacyKvScale"]


class LegacyKvScale(Producer):
    """One ``kv_scale`` per layer (no config)."""

    name = "legacy-kv_scale"
    names = Naming("legacy-kv_scale", {"kv": "self_attn.kv_scale"})
    default_dtype = torch.float32
    per_tensor_shape = ScaleShape.SCALAR

    def scale_facts(
        self, family: str, qcfg: Mapping[str, Any] | None
    ) -> tuple[bool, bool, tuple[str, ...]]:
        return False, False, ("legacy single kv_scale: one scale serves K and V",)

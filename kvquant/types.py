"""Value types shared by the tiers: checkpoint discovery, the scale-format registry, the integrations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = ["Granularity", "LayerGeometry", "RawScale", "ScaleKind"]

Granularity = Literal["per-tensor", "per-head", "fp32-group"]
"""The canonical granularities the kernels consume."""

ScaleKind = Literal["k", "v", "kv"]
"""Which cache a raw scale serves: K, V, or both (a legacy single ``kv_scale``)."""


@dataclass(frozen=True)
class LayerGeometry:
    """Attention geometry of a model, read from its config.

    Attributes:
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads.
        head_dim: elements per head.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class RawScale:
    """One KV scale tensor as a checkpoint stores it, before normalisation.

    Attributes:
        layer: decoder layer index.
        kind: ``"k"``, ``"v"`` or ``"kv"`` (one tensor for both).
        name: the tensor's name in the checkpoint, e.g.
            ``model.layers.3.self_attn.k_scale``.
        convention: the producer convention the name matched, e.g.
            ``"compressed-tensors"``, ``"modelopt"``, ``"quark"``, ``"legacy-kv_scale"``.
        tensor: the tensor exactly as stored (original shape and dtype, on CPU).
        pre_rope: the producer calibrated K before RoPE (Quark's default).
        merged_kv: the producer stores ``max(K, V)`` in both K and V tensors.
        notes: producer facts worth reporting for this tensor.
    """

    layer: int
    kind: ScaleKind
    name: str
    convention: str
    tensor: torch.Tensor
    pre_rope: bool = False
    merged_kv: bool = False
    notes: tuple[str, ...] = field(default=())

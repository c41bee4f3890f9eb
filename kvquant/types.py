"""Value types shared by the tiers: checkpoint discovery, the scale-format registry, the integrations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = [
    "MAX_FIRST_TOKENS",
    "ROTATIONS",
    "Granularity",
    "KTransform",
    "LayerGeometry",
    "RawKTransform",
    "RawOffset",
    "RawScale",
    "ScaleKind",
]

Granularity = Literal["per-tensor", "per-head", "fp32-group", "k-transform"]
"""The canonical granularities the kernels consume (``k-transform``: per-head static
scales plus a per-channel K offset, an optional rotation and full-precision first tokens)."""

ROTATIONS: tuple[str | None, ...] = ("hadamard", None)
"""The K rotations of the ``k-transform`` format: the normalised Hadamard matrix, or none."""

MAX_FIRST_TOKENS = 1024
"""Most first tokens per sequence a ``k-transform`` keeps at full precision (a few are usual)."""

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


@dataclass(frozen=True)
class KTransform:
    """The model-level settings of the ``k-transform`` format.

    Attributes:
        rotation: ``"hadamard"`` (K and the query are multiplied by the
            normalised Hadamard matrix of size ``head_dim``) or ``None`` (no rotation).
        first_tokens: the first visible tokens of each sequence attended from a
            full-precision side buffer instead of the FP8 pages (0: none).
    """

    rotation: str | None = "hadamard"
    first_tokens: int = 1


@dataclass(frozen=True)
class RawOffset:
    """One per-channel K offset tensor as a checkpoint stores it (``k-transform``).

    Attributes:
        layer: decoder layer index.
        name: the tensor's name, e.g. ``model.layers.3.self_attn.k_offset``.
        tensor: the tensor exactly as stored (expected fp32 ``[Hkv, head_dim]``).
    """

    layer: int
    name: str
    tensor: torch.Tensor


@dataclass(frozen=True)
class RawKTransform:
    """A checkpoint's K transform before validation: settings and offset tensors as found.

    Attributes:
        settings: the ``rotation`` and ``first_tokens`` the checkpoint declares.
        offsets: every ``k_offset`` tensor found (any order).
        source: where the settings came from (a file path, or ``"mapping"``).
    """

    settings: KTransform
    offsets: tuple[RawOffset, ...]
    source: str = ""

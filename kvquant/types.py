"""Value types shared by the tiers: checkpoint discovery, the scale-format registry, the integrations."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvquant.errors import ScaleFormatError

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

    Most models give every layer the same KV heads and head_dim. Some mix them
    (Gemma 4: its full-attention layers have ``global_head_dim`` and
    ``num_global_key_value_heads``); then ``layer_num_kv_heads`` and
    ``layer_head_dims`` hold each layer's values, and :meth:`layer` gives the
    geometry one layer's scales are checked against.

    Attributes:
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (the largest layer value when layers differ).
        head_dim: elements per head (the largest layer value when layers differ).
        layer_num_kv_heads: KV heads of each layer, or None when every layer has
            ``num_kv_heads``.
        layer_head_dims: head_dim of each layer, or None when every layer has
            ``head_dim``.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_num_kv_heads: tuple[int, ...] | None = None
    layer_head_dims: tuple[int, ...] | None = None

    @classmethod
    def from_layers(
        cls, num_heads: int, num_kv_heads: Sequence[int], head_dims: Sequence[int]
    ) -> LayerGeometry:
        """The geometry of layers with these KV heads and head_dims (uniform when they agree)."""
        kv, hd = tuple(int(h) for h in num_kv_heads), tuple(int(d) for d in head_dims)
        if not kv or len(kv) != len(hd):
            raise ScaleFormatError(
                f"LayerGeometry.from_layers: {len(kv)} KV-head counts and {len(hd)} head_dims; "
                "expected one of each per layer (at least one layer)."
            )
        return cls(
            num_layers=len(kv),
            num_heads=int(num_heads),
            num_kv_heads=max(kv),
            head_dim=max(hd),
            layer_num_kv_heads=kv if len(set(kv)) > 1 else None,
            layer_head_dims=hd if len(set(hd)) > 1 else None,
        )

    @property
    def uniform(self) -> bool:
        """Whether every layer has ``num_kv_heads`` KV heads of ``head_dim`` elements."""
        return self.layer_num_kv_heads is None and self.layer_head_dims is None

    def kv_heads_of(self, layer: int) -> int:
        """KV heads of decoder layer ``layer``."""
        if self.layer_num_kv_heads is None:
            return self.num_kv_heads
        return self.layer_num_kv_heads[layer]

    def head_dim_of(self, layer: int) -> int:
        """head_dim of decoder layer ``layer``."""
        if self.layer_head_dims is None:
            return self.head_dim
        return self.layer_head_dims[layer]

    def head_dims(self) -> tuple[int, ...]:
        """The distinct head_dims of the layers, ascending."""
        return tuple(sorted({self.head_dim_of(i) for i in range(self.num_layers)}))

    def layer(self, layer: int) -> LayerGeometry:
        """The uniform geometry of one layer (what that layer's scales are checked against)."""
        if self.uniform:
            return self
        return LayerGeometry(
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.kv_heads_of(layer),
            head_dim=self.head_dim_of(layer),
        )

    def describe(self) -> str:
        """``"2 KV heads, head_dim 64"``, or per-layer groups when the layers differ."""
        if self.uniform:
            return f"{self.num_kv_heads} KV heads, head_dim {self.head_dim}"
        groups: dict[tuple[int, int], list[int]] = {}
        for i in range(self.num_layers):
            groups.setdefault((self.kv_heads_of(i), self.head_dim_of(i)), []).append(i)
        parts = [
            f"{kv} KV head{'s' if kv != 1 else ''} x head_dim {d} "
            f"(layer{'s' if len(layers) > 1 else ''} {_ranges(layers)})"
            for (kv, d), layers in groups.items()
        ]
        return "; ".join(parts)


def _ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    start = prev = layers[0]
    for i in [*layers[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(out)


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

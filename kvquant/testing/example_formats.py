"""Two example user scale formats, used by kvquant's tests and docs.

Not registered: ``resolve_scales`` finds one once registered (or in :func:`temporary_format`).

Example:
    >>> import torch
    >>> from kvquant.registry import LayerGeometry, RawScale, resolve_scales, temporary_format
    >>> from kvquant.testing.example_formats import InverseAmaxFormat
    >>> geometry = LayerGeometry(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    >>> raws = [RawScale(0, kind, f"model.layers.0.self_attn.{kind}_scale", "inverse",
    ...                  torch.tensor(448.0 / 8.0)) for kind in ("k", "v")]
    >>> with temporary_format(InverseAmaxFormat()):
    ...     scales = resolve_scales(raws, geometry, scale_format="inverse-amax")
    >>> round(float(scales[0].k) * 448, 4)  # stored 448 / 8 -> scale 8 / 448
    8.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvquant.registry.formats import ScaleFormat
from kvquant.types import Granularity, LayerGeometry

__all__ = ["InverseAmaxFormat", "PerChannelMaxFormat"]


@dataclass(frozen=True)
class PerChannelMaxFormat(ScaleFormat):
    """Per-channel scales ``[Hkv, head_dim]`` reduced with max to per-head ``[Hkv]``.

    The max over a head's channels covers all of them, so nothing saturates;
    channels with smaller ranges lose resolution. (Per-channel K scales come
    from pre-RoPE calibration such as KVQuant's.)
    """

    name: ClassVar[str] = "per-channel-max"
    granularity: ClassVar[Granularity] = "per-head"

    def raw_shapes(self, geometry: LayerGeometry) -> tuple[tuple[int, ...], ...]:
        """``(Hkv, head_dim)``."""
        return ((geometry.num_kv_heads, geometry.head_dim),)

    def convert(self, values: torch.Tensor, geometry: LayerGeometry) -> torch.Tensor:
        """Max over ``head_dim``: ``[Hkv, D]`` -> ``[Hkv]``."""
        return values.amax(dim=-1)


@dataclass(frozen=True)
class InverseAmaxFormat(ScaleFormat):
    """A producer that stores the quantization multiplier ``448 / amax`` per tensor.

    Reads ``()`` or ``(1,)`` and inverts it once, at load time, into the
    dequantization multiplier ``amax / 448``. Same shapes as ``per-tensor``, so
    it is never picked automatically: ask for it with
    ``scale_format="inverse-amax"``.
    """

    name: ClassVar[str] = "inverse-amax"
    granularity: ClassVar[Granularity] = "per-tensor"

    def raw_shapes(self, geometry: LayerGeometry) -> tuple[tuple[int, ...], ...]:
        """``()``, ``(1,)``."""
        return ((), (1,))

    def convert(self, values: torch.Tensor, geometry: LayerGeometry) -> torch.Tensor:
        """``1 / values`` as a scalar."""
        return torch.reciprocal(values.reshape(()))

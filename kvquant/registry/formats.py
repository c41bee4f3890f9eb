"""Scale formats: small frozen value objects that read one checkpoint convention.

A format says which raw tensor shapes it recognises for a layer geometry
(:meth:`ScaleFormat.raw_shapes`) and how to turn one into the canonical fp32
dequantization multiplier the kernels consume (:meth:`ScaleFormat.convert`);
:meth:`ScaleFormat.normalize` wraps ``convert`` with the checks every format
shares. Built-ins: ``per-tensor``, ``per-head``, ``fp32-group`` (dynamic) and
``k-transform`` (a target only). Writing your own: the :class:`ScaleFormat`
example, and docs/custom-formats.md.

Design (the shared checks, the built-ins' shapes, readers and targets):
docs/dev/registry.md.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvquant.errors import ScaleFormatError
from kvquant.registry.policy import (
    canonical_shape,
    check_dtype,
    check_values,
    format_shape,
    format_shapes,
    model_group_size,
    read_values,
)
from kvquant.types import Granularity, LayerGeometry, RawScale

__all__ = [
    "Fp32GroupFormat",
    "KTransformFormat",
    "PerHeadFormat",
    "PerTensorFormat",
    "QueryHeadMaxFormat",
    "ScaleFormat",
]


class ScaleFormat(abc.ABC):
    """Base class of every scale format. Subclasses are ``@dataclass(frozen=True)``.

    Class attributes a subclass sets:

    * ``name`` (str): the registry key, e.g. ``"per-head"``.
    * ``granularity``: the canonical granularity ``convert`` produces:
      ``"per-tensor"`` (fp32 ``[]``), ``"per-head"`` (fp32 ``[num_kv_heads]``),
      ``"fp32-group"`` (dynamic, no tensor) or ``"k-transform"`` (fp32
      ``[num_kv_heads]``; the K offset is read apart).
    * ``dynamic`` (bool, default False): True for formats whose scales are
      computed while the cache is written; they recognise no raw tensor.

    Methods a subclass implements: :meth:`raw_shapes` and :meth:`convert`.
    :meth:`normalize` is the checked entry point; do not override it.

    Writing your own format (a producer that stores per-channel scales):

    Example:
        >>> import torch
        >>> from dataclasses import dataclass
        >>> from kvquant.registry import ScaleFormat, LayerGeometry, RawScale, temporary_format
        >>> @dataclass(frozen=True)
        ... class PerChannelMax(ScaleFormat):
        ...     '''Per-channel ``[Hkv, head_dim]`` scales reduced with max to per-head ``[Hkv]``.'''
        ...
        ...     name = "per-channel-max"
        ...     granularity = "per-head"
        ...
        ...     def raw_shapes(self, geometry):
        ...         return ((geometry.num_kv_heads, geometry.head_dim),)
        ...
        ...     def convert(self, values, geometry):
        ...         return values.amax(dim=-1)
        >>> geometry = LayerGeometry(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8)
        >>> raw = RawScale(0, "k", "model.layers.0.self_attn.k_scale", "custom", torch.full((2, 8), 0.5))
        >>> with temporary_format(PerChannelMax()) as fmt:
        ...     fmt.normalize(raw, geometry)
        tensor([0.5000, 0.5000])
    """

    name: ClassVar[str]
    granularity: ClassVar[Granularity]
    dynamic: ClassVar[bool] = False

    @abc.abstractmethod
    def raw_shapes(self, geometry: LayerGeometry) -> tuple[tuple[int, ...], ...]:
        """The raw tensor shapes this format reads, for a layer geometry.

        Args:
            geometry: the model's attention geometry.

        Returns:
            Shapes as tuples of ints; empty for dynamic formats.
        """

    @abc.abstractmethod
    def convert(self, values: torch.Tensor, geometry: LayerGeometry) -> torch.Tensor:
        """Turn checked raw values into the canonical scale.

        Args:
            values: a fresh fp32 CPU copy of the raw tensor, of one of
                :meth:`raw_shapes`; every value is finite and positive.
            geometry: the model's attention geometry.

        Returns:
            fp32 ``[]`` for per-tensor granularity, ``[num_kv_heads]`` for per-head.
        """

    def check_geometry(self, geometry: LayerGeometry) -> None:
        """Reject a geometry the format cannot serve (default: accept all).

        Args:
            geometry: the model's attention geometry.

        Raises:
            ScaleFormatError: the geometry does not fit the format.
        """
        return None

    def recognizes(self, shape: Sequence[int], geometry: LayerGeometry) -> bool:
        """Whether a raw tensor of ``shape`` is one this format reads.

        Args:
            shape: the raw tensor's shape.
            geometry: the model's attention geometry.
        """
        return tuple(int(s) for s in shape) in self.raw_shapes(geometry)

    def normalize(self, raw: RawScale, geometry: LayerGeometry) -> torch.Tensor:
        """Check a raw scale and convert it to the canonical fp32 form.

        Args:
            raw: the scale as the checkpoint stores it (not modified).
            geometry: the model's attention geometry.

        Returns:
            A new fp32 CPU tensor: ``[]`` (per-tensor) or ``[num_kv_heads]`` (per-head).

        Raises:
            ScaleFormatError: dynamic format, unrecognised shape, non-float dtype,
                bad values, or a ``convert`` that broke the canonical contract.
        """
        if self.dynamic:
            raise ScaleFormatError(
                f"format {self.name!r} computes its scales while the cache is written and "
                f"reads no checkpoint tensor; got {raw.name}. Fix: resolve with "
                f'scale_format="{self.name}" (static scales are then ignored), or pick a '
                "static format such as 'per-tensor' or 'per-head'."
            )
        self.check_geometry(geometry)
        check_dtype(raw)
        shape = tuple(raw.tensor.shape)
        if not self.recognizes(shape, geometry):
            raise ScaleFormatError(
                f"{raw.name} has shape {format_shape(shape)} but format {self.name!r} reads "
                f"{format_shapes(self.raw_shapes(geometry))} for a layer with "
                f"{geometry.num_kv_heads} KV heads and head_dim {geometry.head_dim}. "
                "Fix: pick the format matching the producer (kvquant doctor lists them), or "
                "register one for this shape with kvquant.register_scale_format."
            )
        values = read_values(raw)
        check_values(values, raw.name)
        out = self.convert(values.to(torch.float32), geometry)
        expected = canonical_shape(self.granularity, geometry)
        if (
            not isinstance(out, torch.Tensor)
            or out.dtype != torch.float32
            or tuple(out.shape) != expected
        ):
            found = (
                f"{str(out.dtype).removeprefix('torch.')} of shape {format_shape(out.shape)}"
                if isinstance(out, torch.Tensor)
                else type(out).__name__
            )
            raise ScaleFormatError(
                f"format {self.name!r} ({type(self).__qualname__}) returned {found} for "
                f"{raw.name}; expected float32 of shape {format_shape(expected or ())}. "
                "Fix: make convert() return the canonical fp32 tensor "
                "(kvquant.testing.conformance.check_scale_format finds such bugs)."
            )
        check_values(
            out,
            raw.name,
            stage=f"after format {self.name!r} converted it",
            fix=(
                f"The input was valid, so format {self.name!r} ({type(self).__qualname__}) "
                "produced this value. Fix: check that the checkpoint uses this format's "
                "convention, or the format's convert()."
            ),
        )
        return out.detach().to("cpu").clone()


@dataclass(frozen=True)
class PerTensorFormat(ScaleFormat):
    """One scale per layer and cache: raw ``()``, ``(1,)``, ``(1, 1)`` or ``(1, 1, 1)`` -> fp32 ``[]``.

    The layout of compressed-tensors ``strategy: tensor`` (``(1,)``, bf16),
    ModelOpt (``()``, fp32), Quark (``()``, bf16) and legacy ``kv_scale``.
    """

    name: ClassVar[str] = "per-tensor"
    granularity: ClassVar[Granularity] = "per-tensor"

    def raw_shapes(self, geometry: LayerGeometry) -> tuple[tuple[int, ...], ...]:
        """``()``, ``(1,)``, ``(1, 1)``, ``(1, 1, 1)``."""
        return ((), (1,), (1, 1), (1, 1, 1))

    def convert(self, values: torch.Tensor, geometry: LayerGeometry) -> torch.Tensor:
        """Reshape ``[1...]`` to ``[]``."""
        return values.reshape(())


@dataclass(frozen=True)
class PerHeadFormat(ScaleFormat):
    """One scale per KV head: raw ``(Hkv,)``, ``(Hkv, 1)`` or ``(Hkv, 1, 1)`` -> fp32 ``[Hkv]``.

    The layout of compressed-tensors ``strategy: attn_head`` (``(Hkv, 1, 1)``).
    """

    name: ClassVar[str] = "per-head"
    granularity: ClassVar[Granularity] = "per-head"

    def raw_shapes(self, geometry: LayerGeometry) -> tuple[tuple[int, ...], ...]:
        """``(Hkv,)``, ``(Hkv, 1)``, ``(Hkv, 1, 1)``."""
        h = geometry.num_kv_heads
        return ((h,), (h, 1), (h, 1, 1))

    def convert(self, values: torch.Tensor, geometry: LayerGeometry) -> torch.Tensor:
        """Flatten to ``[Hkv]``."""
        return values.reshape(geometry.num_kv_heads)


@dataclass(frozen=True)
class QueryHeadMaxFormat(ScaleFormat):
    """Scales per *query* head ``(H,)``, ``(H, 1)``, ``(H, 1, 1)`` reduced with max to ``[]``.

    Not registered and never picked automatically: a vector of query-head length
    is rejected unless the caller asked for ``scale_format="per-tensor"``, in
    which case the max covers every head (lossy, logged).
    """

    name: ClassVar[str] = "per-query-head-max"
    granularity: ClassVar[Granularity] = "per-tensor"

    def raw_shapes(self, geometry: LayerGeometry) -> tuple[tuple[int, ...], ...]:
        """``(H,)``, ``(H, 1)``, ``(H, 1, 1)`` with ``H`` the query heads."""
        h = geometry.num_heads
        return ((h,), (h, 1), (h, 1, 1))

    def convert(self, values: torch.Tensor, geometry: LayerGeometry) -> torch.Tensor:
        """Max over all elements."""
        return values.amax().reshape(())


@dataclass(frozen=True)
class Fp32GroupFormat(ScaleFormat):
    """Dynamic scales: one fp32 scale per token, KV head and group of ``group_size`` elements.

    Computed by the write kernel when a token enters the cache
    (``amax(|x_group|) / 448``) and stored beside its page slot as fp32
    ``[num_pages, page_size, Hkv, head_dim // group_size]``. Reads no
    checkpoint tensor.

    Attributes:
        group_size: ``G``, elements per group; must divide ``head_dim``.
    """

    name: ClassVar[str] = "fp32-group"
    granularity: ClassVar[Granularity] = "fp32-group"
    dynamic: ClassVar[bool] = True
    group_size: int = 64

    def raw_shapes(self, geometry: LayerGeometry) -> tuple[tuple[int, ...], ...]:
        """None: the format is dynamic."""
        return ()

    def convert(self, values: torch.Tensor, geometry: LayerGeometry) -> torch.Tensor:
        """Never called: :meth:`normalize` rejects every raw tensor for dynamic formats."""
        raise ScaleFormatError(
            f"format {self.name!r} is dynamic and converts no checkpoint tensor. "
            "Fix: use 'per-tensor' or 'per-head' for static scales."
        )

    def check_geometry(self, geometry: LayerGeometry) -> None:
        """Reject a ``group_size`` that does not divide every layer's ``head_dim``."""
        model_group_size(self.group_size, geometry)


@dataclass(frozen=True)
class KTransformFormat(ScaleFormat):
    """Static per-head scales plus a K transform: per-channel K offset, optional rotation, first tokens.

    A target granularity: K/V scales are read like ``per-tensor`` / ``per-head``
    ones and held per head (a scalar is broadcast, lossless); each layer also
    needs a ``k_offset`` fp32 ``[Hkv, head_dim]`` and the model its settings
    (:class:`~kvquant.types.KTransform`), both from kvquant's own checkpoint
    convention (``kvquant_kv_transform.json`` beside the tensors). The cache
    stores ``fp8((k @ R - c) / s_k)`` and attends with the query rotated alike;
    the first ``first_tokens`` visible tokens of each sequence stay at full
    precision. No serving engine reads it: ``kvquant export`` refuses it.
    """

    name: ClassVar[str] = "k-transform"
    granularity: ClassVar[Granularity] = "k-transform"

    def raw_shapes(self, geometry: LayerGeometry) -> tuple[tuple[int, ...], ...]:
        """The per-tensor and per-head shapes."""
        h = geometry.num_kv_heads
        return ((), (1,), (1, 1), (1, 1, 1), (h,), (h, 1), (h, 1, 1))

    def convert(self, values: torch.Tensor, geometry: LayerGeometry) -> torch.Tensor:
        """A scalar broadcast to every KV head, a per-head vector flattened: ``[Hkv]``."""
        return values.reshape(-1).expand(geometry.num_kv_heads).clone()

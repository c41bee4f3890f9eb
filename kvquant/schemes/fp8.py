"""The FP8 schemes: static per-tensor and per-head scales, dynamic fp32 group scales, and the
k-transform (static per-head scales of K offset and rotated, first tokens at full precision)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvquant.schemes.base import KernelView, Scheme
from kvquant.schemes.checks import (
    SCALE_FIX,
    TRANSFORM_FIX,
    check_finite,
    check_first_tokens,
    check_scale_values,
    checked_head_rotation,
    checked_rotation,
    checked_tensor,
    fail,
    host_copy,
    own_copy,
)

__all__ = ["GroupScales", "KTransformScales", "PerHeadScales", "PerTensorScales", "StaticScales"]


@dataclass(frozen=True, eq=False, repr=False)
class StaticScales(Scheme):
    """Static fp32 K and V dequantization multipliers (``code * scale``), known before any token.

    Attributes:
        k_scale: fp32 ``[]`` (per-tensor) or ``[Hkv]`` (per-head), finite, in
            ``[SCALE_MIN, SCALE_MAX]``.
        v_scale: like ``k_scale``, the same shape.
    """

    k_scale: torch.Tensor
    v_scale: torch.Tensor
    per_head: ClassVar[bool] = False
    first_tokens: ClassVar[int] = 0

    def __post_init__(self) -> None:
        owner = f"{self.name} scales"
        want = "[num_kv_heads]" if self.per_head else "[] (one scale)"
        k = checked_tensor(owner, "k_scale", self.k_scale, want, SCALE_FIX)
        v = checked_tensor(owner, "v_scale", self.v_scale, want, SCALE_FIX)
        self._check_shapes(owner, k, v)
        for label, s in (("k_scale", k), ("v_scale", v)):
            check_scale_values(owner, label, s)
        object.__setattr__(self, "k_scale", own_copy(k))
        object.__setattr__(self, "v_scale", own_copy(v))

    @classmethod
    def scale_shape(cls, num_kv_heads: int) -> tuple[int, ...] | None:
        return (num_kv_heads,) if cls.per_head else ()

    def _check_shapes(self, owner: str, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.per_head:
            if k.dim() != 1 or k.shape[0] < 1:
                raise fail(
                    owner,
                    f"k_scale has shape {tuple(k.shape)}; expected (num_kv_heads,) (one scale "
                    f"per KV head). Fix: pass per-head scales, or use PerTensorScales for one "
                    "scale.",
                )
            want: tuple[int, ...] = (k.shape[0],)
        else:
            want = ()
        for label, s in (("k_scale", k), ("v_scale", v)):
            if tuple(s.shape) != want:
                what = "the shape of k_scale" if self.per_head else "one scale for the tensor"
                raise fail(
                    owner,
                    f"{label} has shape {tuple(s.shape)}; expected {want} ({what}). {SCALE_FIX}",
                )

    @property
    def num_kv_heads(self) -> int | None:
        return int(self.k_scale.shape[0]) if self.k_scale.dim() else None

    def kernel_view(self) -> KernelView:
        return KernelView(self.k_scale, self.v_scale, None, None, None)


@dataclass(frozen=True, eq=False, repr=False)
class PerTensorScales(StaticScales):
    """One fp32 scale for all of K and one for all of V: ``k_scale`` and ``v_scale`` shape ``[]``.

    Example:
        >>> import torch
        >>> PerTensorScales(torch.tensor(0.02), torch.tensor(0.01)).name
        'per-tensor'
    """

    name: ClassVar[str] = "per-tensor"


@dataclass(frozen=True, eq=False, repr=False)
class PerHeadScales(StaticScales):
    """One fp32 scale per KV head for K and for V: ``k_scale`` and ``v_scale`` shape ``[Hkv]``.

    Example:
        >>> import torch
        >>> PerHeadScales(torch.full((4,), 0.02), torch.full((4,), 0.01)).num_kv_heads
        4
    """

    name: ClassVar[str] = "per-head"
    per_head: ClassVar[bool] = True


@dataclass(frozen=True, eq=False, repr=False)
class GroupScales(Scheme):
    """Dynamic fp32 scales: one per (token, KV head, group of ``group_size`` channels).

    Computed when tokens are written (``amax / fp8_max``) and stored beside the pages
    (:class:`Pages` ``k_scales`` / ``v_scales``, ``[num_pages, page_size, Hkv, D // G]``).
    With ``k_rotation`` K is rotated before it is grouped, ``fp8(k @ R / s)`` with ``s`` the
    amax of each group of ``k @ R`` over ``fp8_max``, and the attention rotates the query alike
    (``q @ R``); V is stored as without it.

    Attributes:
        head_dim: ``D``.
        group_size: ``G``, dividing ``head_dim``.
        k_rotation: fp32 ``[D, D]`` orthonormal rotation ``R`` of K (within
            :data:`ORTHONORMAL_TOL`, e.g. :func:`kvquant.kernels.hadamard`), ``D`` a power of
            two >= 16; or None (K stored as given).

    Example:
        >>> GroupScales(head_dim=128, group_size=64).n_groups
        2
    """

    head_dim: int
    group_size: int
    k_rotation: torch.Tensor | None = None
    name: ClassVar[str] = "fp32-group"
    dynamic: ClassVar[bool] = True
    first_tokens: ClassVar[int] = 0

    def __post_init__(self) -> None:
        d, g = self.head_dim, self.group_size
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise fail(
                "fp32-group scales", f"head_dim is {d!r}; expected an int >= 1. Fix: pass the "
                "layer's head dim."
            )  # fmt: skip
        if isinstance(g, bool) or not isinstance(g, int) or g <= 0 or d % g:
            divisors = [x for x in (8, 16, 32, 64, 128) if d % x == 0] or [d]
            raise fail(
                "fp32-group scales",
                f"group_size={g!r} does not divide head_dim {d}; expected a positive divisor. Fix: pass a group_size that "
                f"divides the head dim (e.g. one of {divisors}).",
            )
        if self.k_rotation is not None:
            r = checked_head_rotation("fp32-group scales", self.k_rotation, d)
            object.__setattr__(self, "k_rotation", r)

    @classmethod
    def for_head_dim(
        cls, head_dim: int, group_size: int | None = None, k_rotation: torch.Tensor | None = None
    ) -> GroupScales:
        """``group_size`` or the default: ``min(64, head_dim)``, halved until it divides (80 -> 16)."""
        g = group_size
        if g is None:
            g = min(64, head_dim) if isinstance(head_dim, int) and head_dim > 0 else 64
            while head_dim % g:
                g //= 2
        return cls(head_dim=head_dim, group_size=g, k_rotation=k_rotation)

    @classmethod
    def group_scales(cls, head_dim: int, group_size: int | None = None) -> int:
        """``D // G`` (``group_size`` None: the default of :meth:`for_head_dim`)."""
        return cls.for_head_dim(head_dim, group_size).n_groups

    def dims(self) -> tuple[int | None, int | None]:
        return None, self.head_dim

    @property
    def n_groups(self) -> int:
        """``D // G``: group scales per token and KV head."""
        return self.head_dim // self.group_size

    @property
    def has_rotation(self) -> bool:
        """Whether K is stored rotated (``k_rotation`` given)."""
        return self.k_rotation is not None

    def kernel_view(self) -> KernelView:
        return KernelView(None, None, self.group_size, None, self.k_rotation)


@dataclass(frozen=True, eq=False, repr=False)
class KTransformScales(Scheme):
    """Static scales of K stored offset and rotated: ``fp8((k @ R - c) / k_scale)``.

    Attributes:
        k_scale: fp32 ``[Hkv]`` (or ``[]``) static K scale of the transformed K.
        v_scale: fp32, the shape of ``k_scale``: static V scale (V is not transformed).
        k_offset: fp32 ``[Hkv, D]`` finite per-channel offset ``c`` in the rotated frame, or
            None (no offset).
        k_rotation: fp32 ``[D, D]`` orthonormal rotation ``R`` (within
            :data:`ORTHONORMAL_TOL`, e.g. :func:`kvquant.kernels.hadamard`), or None.
        first_tokens: first visible tokens of each sequence attended from a full-precision
            side buffer (:class:`FirstTokens`), ``0..MAX_FIRST_TOKENS``.
    """

    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_offset: torch.Tensor | None = None
    k_rotation: torch.Tensor | None = None
    first_tokens: int = 0  # type: ignore[misc]  # a field here, 0 on the other schemes
    name: ClassVar[str] = "k-transform"
    transforms_keys: ClassVar[bool] = True

    @classmethod
    def scale_shape(cls, num_kv_heads: int) -> tuple[int, ...] | None:
        """``(num_kv_heads,)``: the registry holds a K transform's scales per head."""
        return (num_kv_heads,)

    def __post_init__(self) -> None:
        owner = "k-transform scales"
        want = "[num_kv_heads] or []"
        k = checked_tensor(owner, "k_scale", self.k_scale, want, SCALE_FIX)
        v = checked_tensor(owner, "v_scale", self.v_scale, want, SCALE_FIX)
        if k.dim() > 1 or tuple(v.shape) != tuple(k.shape):
            raise fail(
                owner,
                f"k_scale {tuple(k.shape)} and v_scale {tuple(v.shape)}; expected both () or "
                f"both (num_kv_heads,). {SCALE_FIX}",
            )
        for label, s in (("k_scale", k), ("v_scale", v)):
            check_scale_values(owner, label, s)
        object.__setattr__(self, "k_scale", own_copy(k))
        object.__setattr__(self, "v_scale", own_copy(v))
        self._check_transform(owner, k)
        check_first_tokens(owner, self.first_tokens)

    def _check_transform(self, owner: str, k: torch.Tensor) -> None:
        """Offset ``[Hkv, D]`` and rotation ``[D, D]``: fp32, finite, orthonormal; own copies."""
        offset, rotation = self.k_offset, self.k_rotation
        d = None
        if rotation is not None:
            r = checked_rotation(owner, rotation)
            d = int(r.shape[0])
            object.__setattr__(self, "k_rotation", r)
        if offset is not None:
            c = checked_tensor(owner, "k_offset", offset, "[num_kv_heads, head_dim]", TRANSFORM_FIX)
            heads = str(k.shape[0]) if k.dim() else "num_kv_heads"
            want = f"({heads}, {'head_dim' if d is None else d})"
            if (
                c.dim() != 2
                or (k.dim() and c.shape[0] != k.shape[0])
                or d not in (None, c.shape[1])
            ):
                raise fail(
                    owner,
                    f"k_offset has shape {tuple(c.shape)}; expected {want} (one offset per KV "
                    f"head and channel, rotated frame). {TRANSFORM_FIX}",
                )
            check_finite(owner, "k_offset", host_copy(c))
            object.__setattr__(self, "k_offset", own_copy(c))

    @property
    def num_kv_heads(self) -> int | None:
        if self.k_scale.dim():
            return int(self.k_scale.shape[0])
        return None if self.k_offset is None else int(self.k_offset.shape[0])

    def dims(self) -> tuple[int | None, int | None]:
        d = next(
            (int(t.shape[-1]) for t in (self.k_rotation, self.k_offset) if t is not None), None
        )
        return self.num_kv_heads, d

    @property
    def has_offset(self) -> bool:
        """Whether K is stored offset (``k_offset`` given)."""
        return self.k_offset is not None

    @property
    def has_rotation(self) -> bool:
        """Whether K is stored rotated (``k_rotation`` given)."""
        return self.k_rotation is not None

    def kernel_view(self) -> KernelView:
        return KernelView(self.k_scale, self.v_scale, None, self.k_offset, self.k_rotation)

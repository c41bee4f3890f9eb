"""The 4-bit schemes: NVFP4 and MXFP4 K and V (K plain, rotated, or in the k-transform's frame),
and FP8 K (plain, or in the k-transform's frame) beside NVFP4 V (block scales computed when
tokens are written; docs/dev/fp4-formats.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvquant.schemes.base import MXFP4, NVFP4, Fp4Format, KernelView, Scheme
from kvquant.schemes.checks import (
    check_first_tokens,
    check_scale_values,
    checked_head_rotation,
    checked_tensor,
    fail,
    own_copy,
)
from kvquant.schemes.fp8 import KTransformScales

__all__ = [
    "DYNAMIC_NVFP4_GLOBAL_SCALE",
    "Fp4Scales",
    "Fp8KNvfp4VScales",
    "KTransformMxfp4Scales",
    "KTransformNvfp4Scales",
    "KTransformNvfp4VScales",
    "Mxfp4Scales",
    "Nvfp4Scales",
]

_FP4_FIX = (
    "Fix: pass fp32 global scales of shape [] or [num_kv_heads] (canonical amax / (6 * 448), "
    "kvquant.registry.fp4.normalize_fp4_global_scale reads a checkpoint's; "
    "kvquant.schemes.DYNAMIC_NVFP4_GLOBAL_SCALE without calibration)."
)

DYNAMIC_NVFP4_GLOBAL_SCALE = 1.0
"""The NVFP4 global scale ``g`` of a calibration-free cache (``kv_format="nvfp4"`` without a
checkpoint's scales). With ``g = 1`` each block's e4m3 scale is ``amax_block / 6`` itself: block
maxima from ``6 * 2^-6 = 0.094`` to ``6 * 448 = 2688`` get a normal e4m3 scale (3 mantissa
bits), smaller ones a subnormal one (coarser, down to ``6 * 2^-9``), larger values saturate at
2688 (as FP8 values clamp at 448 times their scale). A constant needs no statistics, no device
sync and no first batch, and every layer, request and decode graph sees the same one."""


@dataclass(frozen=True, eq=False, repr=False)
class Fp4Scales(Scheme):
    """Base of the 4-bit schemes: K and V pages each FP8 or 4-bit (:class:`Fp4Format`).

    A 4-bit side stores packed e2m1 codes ``uint8 [num_pages, page_size, Hkv, D // 2]`` and
    one scale code per block of head_dim, computed when the token is written and kept beside
    the pages (:class:`Pages` ``k_scales`` / ``v_scales``, ``[num_pages, page_size, Hkv,
    D // block]``); an FP8 side stores FP8 pages with a static fp32 scale. Subclasses fix the
    formats (``k_format`` / ``v_format``, None for FP8) and name the scale tensors.

    Attributes:
        head_dim: ``D``, a multiple of every 4-bit side's block size.
    """

    head_dim: int
    k_format: ClassVar[Fp4Format | None] = None
    v_format: ClassVar[Fp4Format | None] = None
    dynamic: ClassVar[bool] = True
    first_tokens: ClassVar[int] = 0

    def _scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The K and V multipliers the kernels fold (FP8 scale or NVFP4 global scale)."""
        return None, None

    def _check(self, labels: tuple[str | None, str | None]) -> None:
        """Check ``head_dim`` and the scale fields named ``labels`` (K's, V's; None: the side
        has no scale); keep own copies."""
        owner = f"{self.name} scales"
        d = self.head_dim
        blocks = [f.block_size for f in (self.k_format, self.v_format) if f is not None]
        if isinstance(d, bool) or not isinstance(d, int) or d < 1 or any(d % b for b in blocks):
            raise fail(
                owner,
                f"head_dim is {d!r}; expected an int, a multiple of the block size "
                f"{max(blocks)} ({self.name} stores one scale per block of head_dim). Fix: "
                "pass the layer's head dim, or use an FP8 format for a model whose head_dim the "
                "block does not divide.",
            )
        shapes = []
        for label in labels:
            if label is None:
                continue
            t = checked_tensor(owner, label, getattr(self, label), "[] or [num_kv_heads]", _FP4_FIX)
            if t.dim() > 1 or (t.dim() == 1 and t.shape[0] < 1):
                raise fail(
                    owner, f"{label} has shape {tuple(t.shape)}; expected () (one scale) or "
                    f"(num_kv_heads,). {_FP4_FIX}"
                )  # fmt: skip
            fp8 = label == "k_scale"
            meaning = "amax / 448" if fp8 else "NVFP4: amax / (6 * 448)"
            check_scale_values(owner, label, t, meaning, "" if fp8 else _FP4_FIX)
            shapes.append(tuple(t.shape))
            object.__setattr__(self, label, own_copy(t))
        if len(set(shapes)) > 1:
            raise fail(
                owner,
                f"{labels[0]} has shape {shapes[0]} and {labels[1]} {shapes[1]}; expected the "
                f"same shape (both () or both (num_kv_heads,)). {_FP4_FIX}",
            )

    def _check_rotation(self) -> None:
        """``k_rotation`` (NVFP4, MXFP4): None, or an orthonormal fp32 ``[D, D]`` for a
        power-of-two ``D >= MIN_ROTATED_HEAD_DIM``; the scheme's own copy."""
        rotation = getattr(self, "k_rotation", None)
        if rotation is not None:
            r = checked_head_rotation(f"{self.name} scales", rotation, self.head_dim)
            object.__setattr__(self, "k_rotation", r)

    def _check_k_transform(self, k: torch.Tensor | None) -> None:
        """A K transform's fields (``k_offset``, ``k_rotation``, ``first_tokens``): the
        k-transform's own checks (shapes, finite, orthonormal; own copies; ``k``: the scale
        whose heads the offset must have, None: any), for the scheme's ``head_dim``."""
        owner = f"{self.name} scales"
        heads = k if k is not None else torch.ones(())
        KTransformScales._check_transform(self, owner, heads)  # type: ignore[arg-type]
        check_first_tokens(owner, self.first_tokens)
        if self.dims()[1] not in (None, self.head_dim):
            raise fail(
                owner,
                f"k_offset / k_rotation are for head_dim {self.dims()[1]}, the scheme's head_dim "
                f"is {self.head_dim}; expected the same. Fix: pass the layer's K transform.",
            )

    @classmethod
    def kv_format(cls) -> str:
        """The ``kv_format`` word whose pages the scheme stores (``kvquant.patch``): its name."""
        return cls.name

    @classmethod
    def slot_bytes(cls, num_kv_heads: int, head_dim: int, group_size: int | None = None) -> int:
        """Bytes one token slot takes in a layer, K and V together: a 4-bit side's packed codes
        (half a byte per element) and one scale byte per block, an FP8 side's byte per element."""

        def side(fmt: Fp4Format | None) -> int:
            return head_dim if fmt is None else head_dim // 2 + head_dim // fmt.block_size

        return num_kv_heads * (side(cls.k_format) + side(cls.v_format))

    @property
    def num_kv_heads(self) -> int | None:
        heads = next((int(t.shape[0]) for t in self._scales() if t is not None and t.dim()), None)
        offset = getattr(self, "k_offset", None)
        if heads is None and offset is not None:
            return int(offset.shape[0])
        return heads

    def dims(self) -> tuple[int | None, int | None]:
        transform = (getattr(self, "k_rotation", None), getattr(self, "k_offset", None))
        d = next((int(t.shape[-1]) for t in transform if t is not None), None)
        return self.num_kv_heads, self.head_dim if d is None else d

    def kernel_view(self) -> KernelView:
        k, v = self._scales()
        offset, rotation = getattr(self, "k_offset", None), getattr(self, "k_rotation", None)
        return KernelView(k, v, None, offset, rotation, self.k_format, self.v_format)


@dataclass(frozen=True, eq=False, repr=False)
class Nvfp4Scales(Fp4Scales):
    """NVFP4 K and V: e2m1 codes, an e4m3 scale per block of 16 (on write), an fp32 global scale.

    A value is ``(e2m1 * block_scale) * g``; the block scale is
    ``e4m3(min(amax_block / (6 * g), 448))`` (docs/dev/fp4-formats.md). With ``k_rotation`` K
    is rotated before it is quantized (``k @ R``, the query rotated alike; V as given).

    Attributes:
        head_dim: ``D``, a multiple of 16.
        k_global_scale: fp32 ``[]`` or ``[Hkv]``, finite, in ``[SCALE_MIN, SCALE_MAX]``: K's
            ``g`` (canonical ``amax / (6 * 448)``; :data:`DYNAMIC_NVFP4_GLOBAL_SCALE` without
            calibration; of the rotated K with ``k_rotation``).
        v_global_scale: like ``k_global_scale``, the same shape.
        k_rotation: fp32 ``[D, D]`` orthonormal rotation ``R`` of K (e.g.
            :func:`kvquant.kernels.hadamard`; a power-of-two ``D >= MIN_ROTATED_HEAD_DIM``), or
            None.

    Example:
        >>> import torch
        >>> s = Nvfp4Scales(128, torch.tensor(1.0), torch.tensor(1.0))
        >>> s.name, s.kernel_view().v_fp4.block_size
        ('nvfp4', 16)
    """

    k_global_scale: torch.Tensor | None = None
    v_global_scale: torch.Tensor | None = None
    k_rotation: torch.Tensor | None = None
    name: ClassVar[str] = "nvfp4"
    k_format: ClassVar[Fp4Format | None] = NVFP4
    v_format: ClassVar[Fp4Format | None] = NVFP4

    def __post_init__(self) -> None:
        self._check(("k_global_scale", "v_global_scale"))
        self._check_rotation()

    def _scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.k_global_scale, self.v_global_scale


@dataclass(frozen=True, eq=False, repr=False)
class Mxfp4Scales(Fp4Scales):
    """MXFP4 K and V (OCP MX): e2m1 codes and an e8m0 power-of-two scale per block of 32.

    Fully dynamic: every scale is computed when a token is written, none is stored beforehand.
    With ``k_rotation`` K is rotated before it is quantized (as :class:`Nvfp4Scales`).

    Attributes:
        head_dim: ``D``, a multiple of 32.
        k_rotation: fp32 ``[D, D]`` orthonormal rotation ``R`` of K, or None.

    Example:
        >>> Mxfp4Scales(64).kernel_view().k_fp4.name
        'mxfp4'
    """

    k_rotation: torch.Tensor | None = None
    name: ClassVar[str] = "mxfp4"
    k_format: ClassVar[Fp4Format | None] = MXFP4
    v_format: ClassVar[Fp4Format | None] = MXFP4

    def __post_init__(self) -> None:
        self._check((None, None))
        self._check_rotation()


@dataclass(frozen=True, eq=False, repr=False)
class Fp8KNvfp4VScales(Fp4Scales):
    """FP8 K with a static scale and NVFP4 V (ModelOpt's ``FP8_K_NVFP4_V``).

    Attributes:
        head_dim: ``D``, a multiple of 16.
        k_scale: fp32 ``[]`` or ``[Hkv]`` static FP8 K scale (``amax / 448``).
        v_global_scale: fp32, the shape of ``k_scale``: V's NVFP4 global scale ``g``.

    Example:
        >>> import torch
        >>> s = Fp8KNvfp4VScales(64, torch.tensor(0.02), torch.tensor(1.0))
        >>> s.kernel_view().k_fp4 is None, s.kernel_view().v_fp4.name
        (True, 'nvfp4')
    """

    k_scale: torch.Tensor | None = None
    v_global_scale: torch.Tensor | None = None
    name: ClassVar[str] = "fp8-k-nvfp4-v"
    v_format: ClassVar[Fp4Format | None] = NVFP4

    def __post_init__(self) -> None:
        self._check(("k_scale", "v_global_scale"))

    def _scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.k_scale, self.v_global_scale


@dataclass(frozen=True, eq=False, repr=False)
class KTransformNvfp4VScales(Fp4Scales):
    """FP8 K in the k-transform's frame beside NVFP4 V: K as :class:`KTransformScales` stores
    it (``fp8((k @ R - c) / k_scale)``, first tokens at full precision), V as
    :class:`Fp8KNvfp4VScales` does.

    Attributes:
        head_dim: ``D``, a multiple of 16.
        k_scale: fp32 ``[]`` or ``[Hkv]`` static scale of the transformed K.
        v_global_scale: fp32, the shape of ``k_scale``: V's NVFP4 global scale ``g``.
        k_offset: fp32 ``[Hkv, D]`` per-channel offset ``c`` (rotated frame), or None.
        k_rotation: fp32 ``[D, D]`` orthonormal rotation ``R``, or None.
        first_tokens: first visible tokens of each sequence attended from a full-precision
            side buffer (:class:`~kvquant.schemes.FirstTokens`), ``0..MAX_FIRST_TOKENS``.

    Example:
        >>> import torch
        >>> s = KTransformNvfp4VScales(16, torch.tensor(0.02), torch.tensor(1.0),
        ...                            k_offset=torch.zeros(1, 16), first_tokens=1)
        >>> s.kernel_view().k_offset.shape, s.kernel_view().v_fp4.name
        (torch.Size([1, 16]), 'nvfp4')
    """

    k_scale: torch.Tensor | None = None
    v_global_scale: torch.Tensor | None = None
    k_offset: torch.Tensor | None = None
    k_rotation: torch.Tensor | None = None
    # a field here (keyword-only: the base's ClassVar gives it its place among the fields)
    first_tokens: int = field(default=0, kw_only=True)  # type: ignore[misc]
    name: ClassVar[str] = "k-transform-k-nvfp4-v"
    v_format: ClassVar[Fp4Format | None] = NVFP4
    transforms_keys: ClassVar[bool] = True

    @classmethod
    def kv_format(cls) -> str:
        """``fp8-k-nvfp4-v``: the pages are that format's, K in the k-transform's frame."""
        return Fp8KNvfp4VScales.name

    def __post_init__(self) -> None:
        self._check(("k_scale", "v_global_scale"))
        self._check_k_transform(self.k_scale)

    def _scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.k_scale, self.v_global_scale


@dataclass(frozen=True, eq=False, repr=False)
class KTransformNvfp4Scales(Fp4Scales):
    """NVFP4 K in the k-transform's frame beside NVFP4 V: K stored as the NVFP4 codes of
    ``k @ R - c`` (the query rotated alike, the offset's term ``(q @ R)·c`` added to every paged
    key's score), the first tokens at full precision; V as :class:`Nvfp4Scales` stores it.

    Attributes:
        head_dim: ``D``, a multiple of 16.
        k_global_scale: fp32 ``[]`` or ``[Hkv]``: the global scale ``g`` of the transformed K
            (:data:`DYNAMIC_NVFP4_GLOBAL_SCALE` without calibration).
        v_global_scale: like ``k_global_scale``, the same shape: V's.
        k_offset: fp32 ``[Hkv, D]`` per-channel offset ``c`` (rotated frame), or None.
        k_rotation: fp32 ``[D, D]`` orthonormal rotation ``R``, or None.
        first_tokens: first visible tokens of each sequence attended from a full-precision
            side buffer (:class:`~kvquant.schemes.FirstTokens`), ``0..MAX_FIRST_TOKENS``.

    Example:
        >>> import torch
        >>> g = torch.tensor(1.0)
        >>> s = KTransformNvfp4Scales(16, g, g, k_offset=torch.zeros(2, 16), first_tokens=1)
        >>> s.kernel_view().k_fp4.name, s.kernel_view().k_offset.shape, s.kv_format()
        ('nvfp4', torch.Size([2, 16]), 'nvfp4')
    """

    k_global_scale: torch.Tensor | None = None
    v_global_scale: torch.Tensor | None = None
    k_offset: torch.Tensor | None = None
    k_rotation: torch.Tensor | None = None
    # a field here (keyword-only: the base's ClassVar gives it its place among the fields)
    first_tokens: int = field(default=0, kw_only=True)  # type: ignore[misc]
    name: ClassVar[str] = "k-transform-nvfp4"
    k_format: ClassVar[Fp4Format | None] = NVFP4
    v_format: ClassVar[Fp4Format | None] = NVFP4
    transforms_keys: ClassVar[bool] = True

    @classmethod
    def kv_format(cls) -> str:
        """``nvfp4``: the pages are that format's, K in the k-transform's frame."""
        return Nvfp4Scales.name

    def __post_init__(self) -> None:
        self._check(("k_global_scale", "v_global_scale"))
        self._check_k_transform(self.k_global_scale)

    def _scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.k_global_scale, self.v_global_scale


@dataclass(frozen=True, eq=False, repr=False)
class KTransformMxfp4Scales(Fp4Scales):
    """MXFP4 K in the k-transform's frame beside MXFP4 V: as :class:`KTransformNvfp4Scales`,
    with MXFP4's blocks of 32 and power-of-two block scales (no global scale).

    Attributes:
        head_dim: ``D``, a multiple of 32.
        k_offset: fp32 ``[Hkv, D]`` per-channel offset ``c`` (rotated frame), or None.
        k_rotation: fp32 ``[D, D]`` orthonormal rotation ``R``, or None.
        first_tokens: first visible tokens of each sequence kept at full precision.

    Example:
        >>> import torch
        >>> s = KTransformMxfp4Scales(32, torch.zeros(2, 32), first_tokens=1)
        >>> s.kernel_view().k_fp4.name, s.num_kv_heads, s.kv_format()
        ('mxfp4', 2, 'mxfp4')
    """

    k_offset: torch.Tensor | None = None
    k_rotation: torch.Tensor | None = None
    # a field here (keyword-only: the base's ClassVar gives it its place among the fields)
    first_tokens: int = field(default=0, kw_only=True)  # type: ignore[misc]
    name: ClassVar[str] = "k-transform-mxfp4"
    k_format: ClassVar[Fp4Format | None] = MXFP4
    v_format: ClassVar[Fp4Format | None] = MXFP4
    transforms_keys: ClassVar[bool] = True

    @classmethod
    def kv_format(cls) -> str:
        """``mxfp4``: the pages are that format's, K in the k-transform's frame."""
        return Mxfp4Scales.name

    def __post_init__(self) -> None:
        self._check((None, None))
        self._check_k_transform(None)

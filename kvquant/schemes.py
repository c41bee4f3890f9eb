"""Scale schemes, attention masks and page bundles: the frozen values the kernels and caches take.

A scheme says how FP8 codes turn back into numbers: :class:`PerTensorScales` and
:class:`PerHeadScales` (static fp32 K/V scales), :class:`GroupScales` (dynamic fp32 scales per
group of ``group_size`` channels, computed on write) and :class:`KTransformScales` (static scales
of K offset and rotated first); the 4-bit schemes :class:`Nvfp4Scales`, :class:`Mxfp4Scales` and
:class:`Fp8KNvfp4VScales` store e2m1 codes with block scales computed on write (K and V each
in its own format, :class:`Fp4Format`). A scheme checks its tensors once, when it is built, and never
again; :meth:`Scheme.to` moves it without checking. Its ``name`` (the registry's word) is only
for messages, reports and files; :func:`scheme_class` turns a user's word into a class. What
the rest of kvquant needs to know about a scheme its class says (:meth:`Scheme.scale_shape`,
:meth:`Scheme.group_scales`, :meth:`Scheme.slot_bytes`, ``dynamic``, ``transforms_keys``), so
that a new scheme is a new class, not a new branch elsewhere.
:class:`Mask` holds what the attention masks, :class:`Pages` the page tensors (and group scales)
and :class:`FirstTokens` the k-transform's full-precision side buffer. Imports torch only;
design: docs/dev/kernels.md (Schemes).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple, TypeVar

import torch

from kvquant.errors import ScaleFormatError
from kvquant.types import MAX_FIRST_TOKENS

__all__ = [
    "CAUSAL",
    "DYNAMIC_NVFP4_GLOBAL_SCALE",
    "FP4_FORMATS",
    "MXFP4",
    "NVFP4",
    "ORTHONORMAL_TOL",
    "SCALE_MAX",
    "SCALE_MIN",
    "FirstTokens",
    "Fp4Format",
    "Fp4Scales",
    "Fp8KNvfp4VScales",
    "GroupScales",
    "KTransformScales",
    "KernelView",
    "Mask",
    "Mxfp4Scales",
    "Nvfp4Scales",
    "Pages",
    "PerHeadScales",
    "PerTensorScales",
    "Scheme",
    "StaticScales",
    "scheme_class",
    "scheme_names",
]

SCALE_MIN = 2.0**-117
"""Smallest static scale accepted (the registry's ``MIN_SCALE``: 1/scale and the smallest
code times scale stay normal fp32 numbers)."""

SCALE_MAX = 2.0**100
"""Largest static scale accepted (the registry's ``MAX_SCALE``)."""

ORTHONORMAL_TOL = 1e-4
"""Largest ``|R R^T - I|`` element accepted for a K rotation (checked once, at construction)."""

_SCALE_FIX = (
    "Fix: normalise scales with kvquant.registry (it returns fp32 [] or [num_kv_heads] "
    "tensors on the cache's device)."
)
_TRANSFORM_FIX = (
    "Fix: build k_offset [num_kv_heads, head_dim] and k_rotation [head_dim, head_dim] as fp32 "
    "tensors (kvquant.kernels.hadamard(head_dim) for the rotation), or pass the K transform "
    "kvquant.registry resolved for the model."
)

_S = TypeVar("_S", bound="Scheme")


@dataclass(frozen=True)
class Fp4Format:
    """One 4-bit KV format: e2m1 values in blocks along head_dim, one scale code per block.

    Attributes:
        name: ``"nvfp4"`` or ``"mxfp4"``.
        block_size: elements of head_dim sharing one scale (16 or 32).
        scale_dtype: dtype of the block-scale tensor (``float8_e4m3fn``; ``uint8`` e8m0 codes).
        global_scale: whether an fp32 global scale multiplies the block scales (NVFP4).
        nan_scale_code: the scale byte a block holding a non-finite value stores.
    """

    name: str
    block_size: int
    scale_dtype: torch.dtype
    global_scale: bool
    nan_scale_code: int


NVFP4 = Fp4Format("nvfp4", 16, torch.float8_e4m3fn, True, 0x7F)
"""NVIDIA's NVFP4: block 16, e4m3fn block scale, fp32 global scale."""

MXFP4 = Fp4Format("mxfp4", 32, torch.uint8, False, 0xFF)
"""OCP MXFP4: block 32, e8m0 power-of-two scale (uint8 code ``E``, ``2^(E - 127)``)."""

FP4_FORMATS: tuple[Fp4Format, ...] = (NVFP4, MXFP4)
"""The 4-bit formats the kernels store."""


class KernelView(NamedTuple):
    """What a kernel reads from a scheme: tensors (None when absent) and the group size.

    ``k_fp4`` / ``v_fp4`` name the 4-bit format of K / V pages (None: FP8 pages); a 4-bit
    side's ``k_scale`` / ``v_scale`` is NVFP4's global scale (None for MXFP4).
    """

    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    group_size: int | None
    k_offset: torch.Tensor | None
    k_rotation: torch.Tensor | None
    k_fp4: Fp4Format | None = None
    v_fp4: Fp4Format | None = None


_CLASSES: dict[str, type[Scheme]] = {}


def _fail(scheme: str, msg: str) -> ScaleFormatError:
    return ScaleFormatError(f"{scheme}: {msg}")


def _tensor(scheme: str, label: str, x: object, want: str, fix: str) -> torch.Tensor:
    """``x`` as a detached fp32 tensor (refusing anything else), not yet copied."""
    if not isinstance(x, torch.Tensor):
        raise _fail(
            scheme, f"{label} is a {type(x).__name__}; expected an fp32 tensor {want}. {fix}"
        )
    if x.dtype != torch.float32:
        raise _fail(scheme, f"{label} has dtype {x.dtype}; expected torch.float32 {want}. {fix}")
    return x.detach()


def _host(x: torch.Tensor) -> torch.Tensor:
    """A CPU copy to read values from (the tensor itself when already on the CPU)."""
    return x if x.device.type == "cpu" else x.cpu()


def _own(x: torch.Tensor) -> torch.Tensor:
    """The scheme's own contiguous copy (the caller may change theirs later)."""
    return x.clone(memory_format=torch.contiguous_format)


def _check_scale_values(
    scheme: str, label: str, scale: torch.Tensor, meaning: str = "amax / 448", fix: str = ""
) -> None:
    flat = _host(scale).reshape(-1)
    ok = torch.isfinite(flat) & (flat >= SCALE_MIN) & (flat <= SCALE_MAX)
    if not bool(ok.all()):
        index = int((~ok).nonzero()[0, 0])
        raise _fail(
            scheme,
            f"{label} element {index} is {float(flat[index])!r}; expected finite "
            f"dequantization multipliers in [{SCALE_MIN:.3g}, {SCALE_MAX:.3g}] ({meaning}): a "
            "zero, negative, NaN, infinite or subnormal scale stores or reads garbage. "
            f"{fix or _SCALE_FIX}",
        )


def _check_finite(scheme: str, label: str, host: torch.Tensor) -> None:
    flat = host.reshape(-1)
    ok = torch.isfinite(flat)
    if not bool(ok.all()):
        index = int((~ok).nonzero()[0, 0])
        raise _fail(
            scheme,
            f"{label} element {index} is {float(flat[index])!r}; expected finite values. "
            f"{_TRANSFORM_FIX}",
        )


@dataclass(frozen=True, eq=False)
class Scheme(abc.ABC):
    """Base of the scale schemes: a frozen value checked once, when built.

    Subclasses set ``name`` (the registry's word, for messages, reports and files only) and
    ``dynamic`` (scales computed when tokens are written, kept beside the pages).
    """

    name: ClassVar[str] = ""
    dynamic: ClassVar[bool] = False
    transforms_keys: ClassVar[bool] = False
    """Whether K is stored transformed (offset, rotated): the layer needs a K transform."""
    if TYPE_CHECKING:
        first_tokens: ClassVar[int]
        """First visible tokens per sequence kept at full precision (0 but for the k-transform)."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            _CLASSES[cls.name] = cls

    @classmethod
    def scale_shape(cls, num_kv_heads: int) -> tuple[int, ...] | None:
        """Shape of the scheme's static K (and V) scale: ``()`` one for the tensor,
        ``(num_kv_heads,)`` one per KV head, None: no static scale (computed when written)."""
        return None

    @classmethod
    def group_scales(cls, head_dim: int, group_size: int | None = None) -> int:
        """fp32 scales stored beside the pages per token and KV head (0: none)."""
        return 0

    @classmethod
    def slot_bytes(cls, num_kv_heads: int, head_dim: int, group_size: int | None = None) -> int:
        """Bytes one token slot takes in a layer, K and V together: the FP8 codes (one byte per
        element) and the scales stored per token (:meth:`group_scales`, fp32)."""
        per_head = head_dim + 4 * cls.group_scales(head_dim, group_size)
        return 2 * num_kv_heads * per_head

    @property
    def num_kv_heads(self) -> int | None:
        """``Hkv`` the scheme's tensors are built for, None when they do not say."""
        return None

    def dims(self) -> tuple[int | None, int | None]:
        """``(Hkv, D)`` the scheme's tensors are built for, None where they do not say."""
        return self.num_kv_heads, None

    @abc.abstractmethod
    def kernel_view(self) -> KernelView:
        """The tensors and group size the kernels read (flags derive from what is None)."""

    def to(self: _S, device: torch.device | str) -> _S:
        """A copy with every tensor on ``device`` (not checked again: no host read, no sync).

        From pinned CPU memory the copies do not wait for the device's queued work.
        """
        dev = torch.device(device)
        moved = {
            f.name: (
                v.to(device=dev, non_blocking=dev.type != "cpu")
                if isinstance(v, torch.Tensor)
                else v
            )
            for f in dataclasses.fields(self)
            for v in (getattr(self, f.name),)
        }
        return self._trusted(moved)

    def flatten(self) -> tuple[str, list[int], list[torch.Tensor | None]]:
        """``(name, ints, tensors)``: the scheme as a custom op's arguments (:meth:`unflatten`)."""
        ints, tensors = [], []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor) or v is None:
                tensors.append(v)
            else:
                ints.append(int(v))
        return self.name, ints, tensors

    @staticmethod
    def unflatten(name: str, ints: list[int], tensors: list[torch.Tensor | None]) -> Scheme:
        """The scheme :meth:`flatten` gave (not checked again)."""
        cls = scheme_class(name)
        it_i, it_t = iter(ints), iter(tensors)
        values = {
            f.name: (next(it_t) if f.type in _TENSOR_TYPES else next(it_i))
            for f in dataclasses.fields(cls)
        }
        return cls._trusted(values)

    @classmethod
    def _trusted(cls: type[_S], values: Mapping[str, object]) -> _S:
        """An instance holding ``values`` as they are (already checked)."""
        obj = object.__new__(cls)
        for key, value in values.items():
            object.__setattr__(obj, key, value)
        return obj

    def __repr__(self) -> str:
        parts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            parts.append(
                f"{f.name}=<{'x'.join(map(str, v.shape)) or 'scalar'} on {v.device}>"
                if isinstance(v, torch.Tensor)
                else f"{f.name}={v!r}"
            )
        return f"{type(self).__name__}({', '.join(parts)})"


_TENSOR_TYPES = ("torch.Tensor", "torch.Tensor | None")


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
        k = _tensor(owner, "k_scale", self.k_scale, want, _SCALE_FIX)
        v = _tensor(owner, "v_scale", self.v_scale, want, _SCALE_FIX)
        self._check_shapes(owner, k, v)
        for label, s in (("k_scale", k), ("v_scale", v)):
            _check_scale_values(owner, label, s)
        object.__setattr__(self, "k_scale", _own(k))
        object.__setattr__(self, "v_scale", _own(v))

    @classmethod
    def scale_shape(cls, num_kv_heads: int) -> tuple[int, ...] | None:
        return (num_kv_heads,) if cls.per_head else ()

    def _check_shapes(self, owner: str, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.per_head:
            if k.dim() != 1 or k.shape[0] < 1:
                raise _fail(
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
                raise _fail(
                    owner,
                    f"{label} has shape {tuple(s.shape)}; expected {want} ({what}). {_SCALE_FIX}",
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

    Attributes:
        head_dim: ``D``.
        group_size: ``G``, dividing ``head_dim``.

    Example:
        >>> GroupScales(head_dim=128, group_size=64).n_groups
        2
    """

    head_dim: int
    group_size: int
    name: ClassVar[str] = "fp32-group"
    dynamic: ClassVar[bool] = True
    first_tokens: ClassVar[int] = 0

    def __post_init__(self) -> None:
        d, g = self.head_dim, self.group_size
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise _fail(
                "fp32-group scales", f"head_dim is {d!r}; expected an int >= 1. Fix: pass the "
                "layer's head dim."
            )  # fmt: skip
        if isinstance(g, bool) or not isinstance(g, int) or g <= 0 or d % g:
            divisors = [x for x in (8, 16, 32, 64, 128) if d % x == 0] or [d]
            raise _fail(
                "fp32-group scales",
                f"group_size={g!r} does not divide head_dim {d}; expected a positive divisor. Fix: pass a group_size that "
                f"divides the head dim (e.g. one of {divisors}).",
            )

    @classmethod
    def for_head_dim(cls, head_dim: int, group_size: int | None = None) -> GroupScales:
        """``group_size`` or the default: ``min(64, head_dim)``, halved until it divides (80 -> 16)."""
        g = group_size
        if g is None:
            g = min(64, head_dim) if isinstance(head_dim, int) and head_dim > 0 else 64
            while head_dim % g:
                g //= 2
        return cls(head_dim=head_dim, group_size=g)

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

    def kernel_view(self) -> KernelView:
        return KernelView(None, None, self.group_size, None, None)


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
        k = _tensor(owner, "k_scale", self.k_scale, want, _SCALE_FIX)
        v = _tensor(owner, "v_scale", self.v_scale, want, _SCALE_FIX)
        if k.dim() > 1 or tuple(v.shape) != tuple(k.shape):
            raise _fail(
                owner,
                f"k_scale {tuple(k.shape)} and v_scale {tuple(v.shape)}; expected both () or "
                f"both (num_kv_heads,). {_SCALE_FIX}",
            )
        for label, s in (("k_scale", k), ("v_scale", v)):
            _check_scale_values(owner, label, s)
        object.__setattr__(self, "k_scale", _own(k))
        object.__setattr__(self, "v_scale", _own(v))
        self._check_transform(owner, k)
        nf = self.first_tokens
        if isinstance(nf, bool) or not isinstance(nf, int) or not 0 <= nf <= MAX_FIRST_TOKENS:
            raise _fail(
                owner,
                f"first_tokens is {nf!r}; expected an int from 0 to {MAX_FIRST_TOKENS}. Fix: "
                "pass the first_tokens of the checkpoint's K transform (1 is usual).",
            )

    def _check_transform(self, owner: str, k: torch.Tensor) -> None:
        """Offset ``[Hkv, D]`` and rotation ``[D, D]``: fp32, finite, orthonormal; own copies."""
        offset, rotation = self.k_offset, self.k_rotation
        d = None
        if rotation is not None:
            r = _tensor(owner, "k_rotation", rotation, "[head_dim, head_dim]", _TRANSFORM_FIX)
            if r.dim() != 2 or r.shape[0] != r.shape[1]:
                raise _fail(
                    owner, f"k_rotation has shape {tuple(r.shape)}; expected (head_dim, "
                    f"head_dim). {_TRANSFORM_FIX}"
                )  # fmt: skip
            d = int(r.shape[0])
            host = _host(r)
            _check_finite(owner, "k_rotation", host)
            err = float((host @ host.T - torch.eye(d)).abs().max())
            if err > ORTHONORMAL_TOL:
                raise _fail(
                    owner,
                    f"k_rotation is not orthonormal (max |R R^T - I| = {err:.3g}, expected <= "
                    f"{ORTHONORMAL_TOL:g}); the query would not be rotated back exactly. Fix: "
                    "pass kvquant.kernels.hadamard(head_dim), or None.",
                )
            object.__setattr__(self, "k_rotation", _own(r))
        if offset is not None:
            c = _tensor(owner, "k_offset", offset, "[num_kv_heads, head_dim]", _TRANSFORM_FIX)
            heads = str(k.shape[0]) if k.dim() else "num_kv_heads"
            want = f"({heads}, {'head_dim' if d is None else d})"
            if (
                c.dim() != 2
                or (k.dim() and c.shape[0] != k.shape[0])
                or d not in (None, c.shape[1])
            ):
                raise _fail(
                    owner,
                    f"k_offset has shape {tuple(c.shape)}; expected {want} (one offset per KV "
                    f"head and channel, rotated frame). {_TRANSFORM_FIX}",
                )
            _check_finite(owner, "k_offset", _host(c))
            object.__setattr__(self, "k_offset", _own(c))

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
            raise _fail(
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
            t = _tensor(owner, label, getattr(self, label), "[] or [num_kv_heads]", _FP4_FIX)
            if t.dim() > 1 or (t.dim() == 1 and t.shape[0] < 1):
                raise _fail(
                    owner, f"{label} has shape {tuple(t.shape)}; expected () (one scale) or "
                    f"(num_kv_heads,). {_FP4_FIX}"
                )  # fmt: skip
            fp8 = label == "k_scale"
            meaning = "amax / 448" if fp8 else "NVFP4: amax / (6 * 448)"
            _check_scale_values(owner, label, t, meaning, "" if fp8 else _FP4_FIX)
            shapes.append(tuple(t.shape))
            object.__setattr__(self, label, _own(t))
        if len(set(shapes)) > 1:
            raise _fail(
                owner,
                f"{labels[0]} has shape {shapes[0]} and {labels[1]} {shapes[1]}; expected the "
                f"same shape (both () or both (num_kv_heads,)). {_FP4_FIX}",
            )

    @classmethod
    def slot_bytes(cls, num_kv_heads: int, head_dim: int, group_size: int | None = None) -> int:
        """Bytes one token slot takes in a layer, K and V together: a 4-bit side's packed codes
        (half a byte per element) and one scale byte per block, an FP8 side's byte per element."""

        def side(fmt: Fp4Format | None) -> int:
            return head_dim if fmt is None else head_dim // 2 + head_dim // fmt.block_size

        return num_kv_heads * (side(cls.k_format) + side(cls.v_format))

    @property
    def num_kv_heads(self) -> int | None:
        return next((int(t.shape[0]) for t in self._scales() if t is not None and t.dim()), None)

    def dims(self) -> tuple[int | None, int | None]:
        return self.num_kv_heads, self.head_dim

    def kernel_view(self) -> KernelView:
        k, v = self._scales()
        return KernelView(k, v, None, None, None, self.k_format, self.v_format)


@dataclass(frozen=True, eq=False, repr=False)
class Nvfp4Scales(Fp4Scales):
    """NVFP4 K and V: e2m1 codes, an e4m3 scale per block of 16 (on write), an fp32 global scale.

    A value is ``(e2m1 * block_scale) * g``; the block scale is
    ``e4m3(min(amax_block / (6 * g), 448))`` (docs/dev/fp4-formats.md).

    Attributes:
        head_dim: ``D``, a multiple of 16.
        k_global_scale: fp32 ``[]`` or ``[Hkv]``, finite, in ``[SCALE_MIN, SCALE_MAX]``: K's
            ``g`` (canonical ``amax / (6 * 448)``; :data:`DYNAMIC_NVFP4_GLOBAL_SCALE` without
            calibration).
        v_global_scale: like ``k_global_scale``, the same shape.

    Example:
        >>> import torch
        >>> s = Nvfp4Scales(128, torch.tensor(1.0), torch.tensor(1.0))
        >>> s.name, s.kernel_view().v_fp4.block_size
        ('nvfp4', 16)
    """

    k_global_scale: torch.Tensor | None = None
    v_global_scale: torch.Tensor | None = None
    name: ClassVar[str] = "nvfp4"
    k_format: ClassVar[Fp4Format | None] = NVFP4
    v_format: ClassVar[Fp4Format | None] = NVFP4

    def __post_init__(self) -> None:
        self._check(("k_global_scale", "v_global_scale"))

    def _scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.k_global_scale, self.v_global_scale


@dataclass(frozen=True, eq=False, repr=False)
class Mxfp4Scales(Fp4Scales):
    """MXFP4 K and V (OCP MX): e2m1 codes and an e8m0 power-of-two scale per block of 32.

    Fully dynamic: every scale is computed when a token is written, none is stored beforehand.

    Attributes:
        head_dim: ``D``, a multiple of 32.

    Example:
        >>> Mxfp4Scales(64).kernel_view().k_fp4.name
        'mxfp4'
    """

    name: ClassVar[str] = "mxfp4"
    k_format: ClassVar[Fp4Format | None] = MXFP4
    v_format: ClassVar[Fp4Format | None] = MXFP4

    def __post_init__(self) -> None:
        self._check((None, None))


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


def scheme_names() -> tuple[str, ...]:
    """The words naming the schemes (``"per-tensor"``, ``"per-head"``, ...), in definition order."""
    return tuple(_CLASSES)


def scheme_class(word: str) -> type[Scheme]:
    """The scheme class a user's word names (the CLI's and the config's words).

    Raises:
        ScaleFormatError: an unknown word (the message lists the known ones).
    """
    cls = _CLASSES.get(word)
    if cls is None:
        raise ScaleFormatError(
            f"scale scheme {word!r} is unknown; expected one of {scheme_names()}. Fix: pass one "
            "of those."
        )
    return cls


@dataclass(frozen=True)
class Mask:
    """Which keys each query sees, and how its scores are shaped (checked per attention call).

    Key ``j`` of sequence ``b`` is visible to the query at position ``p`` when
    ``kv_start[b] <= j < seq_lens[b]``, ``j <= p`` (if ``causal``) and ``j > p - window`` (if
    ``window > 0``).

    Attributes:
        causal: mask keys after each query's position.
        window: if > 0, each query sees only the last ``window`` positions.
        softcap: if > 0 (finite), scores become ``softcap * tanh(scores / softcap)``.
        kv_start: int32 ``[B]`` first visible key (left padding), or None (0).
        q_lens: int32 ``[B]`` valid query tokens per sequence, or None (all ``Lq``).
        sinks: fp32 ``[Hq]`` learned attention-sink logits (gpt-oss), contiguous and finite, or
            None: each head's softmax denominator gets ``exp(sinks[h])``.
    """

    causal: bool = True
    window: int = 0
    softcap: float = 0.0
    kv_start: torch.Tensor | None = None
    q_lens: torch.Tensor | None = None
    sinks: torch.Tensor | None = None


CAUSAL = Mask()
"""The default mask: causal, no window, no softcap, no padding, every query valid, no sinks."""


@dataclass(frozen=True)
class Pages:
    """One layer's pages, and their group or block scales for a dynamic scheme (checked per call).

    Attributes:
        k: FP8 ``[num_pages, page_size, Hkv, D]`` keys, any strides (fastest from
            :func:`kvquant.kernels.page_storage`); for a 4-bit K (:class:`Fp4Scales`) packed
            e2m1 codes ``uint8 [num_pages, page_size, Hkv, D // 2]``, last dimension
            contiguous (:func:`kvquant.kernels.fp4.fp4_page_storage`).
        v: like ``k`` (same dtype for FP8 K and V).
        k_scales: fp32 ``[num_pages, page_size, Hkv, D // G]`` group scales of K
            (:class:`GroupScales`; from :func:`kvquant.kernels.group_scale_storage`), the
            block scales of a 4-bit K (``[num_pages, page_size, Hkv, D // block]`` in the
            format's ``scale_dtype``, last dimension contiguous), or None.
        v_scales: like ``k_scales`` for V.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None


@dataclass(frozen=True)
class FirstTokens:
    """The k-transform's full-precision side buffer of each sequence's first tokens.

    Attributes:
        k: ``[B, NF, Hkv, D]`` fp32/fp16/bf16 keys in the rotated frame (``k @ R``, no offset).
        v: ``[B, NF, Hkv, D]`` their values, as the model produced them.
        lens: int32 ``[B]``, ``0..NF``: keys ``kv_start[b] .. kv_start[b] + lens[b] - 1`` are
            read from here instead of their slots (which are never read).
    """

    k: torch.Tensor
    v: torch.Tensor
    lens: torch.Tensor

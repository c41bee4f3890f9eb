"""Scale schemes, attention masks and page bundles: the frozen values the kernels and caches take.

A scheme says how FP8 codes turn back into numbers: :class:`PerTensorScales` and
:class:`PerHeadScales` (static fp32 K/V scales), :class:`GroupScales` (dynamic fp32 scales per
group of ``group_size`` channels, computed on write) and :class:`KTransformScales` (static scales
of K offset and rotated first). A scheme checks its tensors once, when it is built, and never
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
    "ORTHONORMAL_TOL",
    "SCALE_MAX",
    "SCALE_MIN",
    "FirstTokens",
    "GroupScales",
    "KTransformScales",
    "KernelView",
    "Mask",
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


class KernelView(NamedTuple):
    """What a kernel reads from a scheme: tensors (None when absent) and the group size."""

    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    group_size: int | None
    k_offset: torch.Tensor | None
    k_rotation: torch.Tensor | None


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


def _check_scale_values(scheme: str, label: str, scale: torch.Tensor) -> None:
    flat = _host(scale).reshape(-1)
    ok = torch.isfinite(flat) & (flat >= SCALE_MIN) & (flat <= SCALE_MAX)
    if not bool(ok.all()):
        index = int((~ok).nonzero()[0, 0])
        raise _fail(
            scheme,
            f"{label} element {index} is {float(flat[index])!r}; expected finite "
            f"dequantization multipliers in [{SCALE_MIN:.3g}, {SCALE_MAX:.3g}] (amax / 448): a "
            "zero, negative, NaN, infinite or subnormal scale stores or reads garbage. "
            f"{_SCALE_FIX}",
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
    """One layer's FP8 pages, and their group scales for a dynamic scheme (checked per call).

    Attributes:
        k: FP8 ``[num_pages, page_size, Hkv, D]`` keys, any strides (fastest from
            :func:`kvquant.kernels.page_storage`).
        v: like ``k`` (same dtype).
        k_scales: fp32 ``[num_pages, page_size, Hkv, D // G]`` group scales of K
            (:class:`GroupScales`; from :func:`kvquant.kernels.group_scale_storage`), or None.
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

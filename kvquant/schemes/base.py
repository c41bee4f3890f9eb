"""The scheme base class, what a kernel reads from a scheme (:class:`KernelView`), the 4-bit
formats' descriptions (:class:`Fp4Format`) and the word-to-class lookup (:func:`scheme_class`)."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple, TypeVar

import torch

from kvquant.errors import ScaleFormatError

__all__ = [
    "FP4_FORMATS",
    "MXFP4",
    "NVFP4",
    "Fp4Format",
    "KernelView",
    "Scheme",
    "fp4_format",
    "scheme_class",
    "scheme_names",
]

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


def fp4_format(word: str) -> Fp4Format | None:
    """The 4-bit format a side's word names (``"nvfp4"``, ``"mxfp4"``), None for any other
    word (``"fp8"``): a caller parses the word once, then asks the format."""
    return next((f for f in FP4_FORMATS if f.name == word), None)


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

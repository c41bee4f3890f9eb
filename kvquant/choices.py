"""Options that take one of a few words, as types: ``str`` enums with a docstring per member.

A member equals, hashes, formats and prints as its word (``Backend.AUTO == "auto"``,
``repr(Backend.AUTO) == "'auto'"``), so a user passes either, and messages, JSON and saved
configs read as plain words. :func:`parse_choice` turns a user's value into a member, or None
for the caller's own error message.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

__all__ = [
    "Backend",
    "Choice",
    "KVFormat",
    "MissingKV",
    "MissingScales",
    "RopePolicy",
    "coerce_choice",
    "parse_choice",
]


class Choice(str, Enum):
    """Base of kvquant's choices: ``str()``, f-strings and ``repr()`` give the word."""

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """The words, in the order the members are declared."""
        return tuple(str(m.value) for m in cls)


class Backend(Choice):
    """Which implementation runs kvquant's kernels."""

    AUTO = "auto"
    """Triton on CUDA devices, the pure-PyTorch reference elsewhere."""
    TRITON = "triton"
    """The Triton kernels (on CPU only under ``TRITON_INTERPRET=1``)."""
    TORCH = "torch"
    """The pure-PyTorch reference over the same paged layout (any device)."""


class KVFormat(Choice):
    """How the paged cache stores K and V (``kvquant.patch(model, kv_format=...)``)."""

    FP8 = "fp8"
    """FP8 (e4m3) K and V with the scales resolved for the model: the checkpoint's static
    scales, or scales per group of channels computed as tokens are written."""
    NVFP4 = "nvfp4"
    """NVFP4 K and V: 4-bit e2m1 values with an FP8 scale per 16 channels computed as tokens
    are written and a fixed global scale (no calibration): 0.56 bytes per element."""
    MXFP4 = "mxfp4"
    """MXFP4 K and V (OCP MX): 4-bit e2m1 values with a power-of-two scale per 32 channels
    computed as tokens are written: 0.53 bytes per element."""
    FP8_K_NVFP4_V = "fp8-k-nvfp4-v"
    """FP8 K with the model's static K scale, NVFP4 V (as :attr:`NVFP4`): needs static K
    scales (a checkpoint's, or ``missing_scales="unit"``)."""


class MissingScales(Choice):
    """What resolving does when no layer has a KV scale."""

    DYNAMIC = "dynamic"
    """Store K/V with per-group scales computed as tokens arrive (``fp32-group``)."""
    ERROR = "error"
    """Refuse with a :class:`~kvquant.errors.ScaleFormatError` naming the fix."""
    UNIT = "unit"
    """Use scale 1.0 for every layer (only right for K/V already within FP8's range)."""


class MissingKV(Choice):
    """What resolving does with a layer that has a K scale and no V scale, or the reverse."""

    ERROR = "error"
    """Refuse, naming the layer and the missing tensor."""
    REUSE = "reuse"
    """Use the scale that is there for both (logged)."""


class RopePolicy(Choice):
    """What resolving does with K scales calibrated before RoPE was applied."""

    WIDEN = "widen"
    """Widen them by the bound RoPE can grow a K channel pair's magnitude by (logged)."""
    KEEP = "keep"
    """Keep them as they are (the producer vouches for the range)."""


C = TypeVar("C", bound=Choice)


def parse_choice(kind: type[C], value: object) -> C | None:
    """The member of ``kind`` that ``value`` (a member or its word) names, or None."""
    try:
        return kind(value)
    except (ValueError, TypeError):
        return None


def coerce_choice(kind: type[C], value: object) -> object:
    """``value`` as a member of ``kind`` where it names one; otherwise unchanged (for the
    caller's validation, which words its own error)."""
    member = parse_choice(kind, value)
    return value if member is None else member

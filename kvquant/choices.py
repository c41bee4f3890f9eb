"""Options that take one of a few words, as types: ``str`` enums with a docstring per member.

A member equals, hashes, formats and prints as its word (``Backend.AUTO == "auto"``,
``repr(Backend.AUTO) == "'auto'"``), so a user passes either, and messages, JSON and saved
configs read as plain words. :func:`parse_choice` turns a user's value into a member, or None
for the caller's own error message.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import TypeVar

from kvquant.errors import OptionError, OptionTypeError

__all__ = [
    "DEFAULT_LAYER",
    "Backend",
    "Choice",
    "KRotation",
    "KVFormat",
    "KVFormatMap",
    "MissingKV",
    "MissingScales",
    "RopePolicy",
    "check_kv_format",
    "coerce_choice",
    "describe_layer_formats",
    "kv_format_json",
    "layer_kv_formats",
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

    @property
    def sides(self) -> tuple[KVFormat, KVFormat]:
        """``(K, V)``: how each side is stored, as the format storing both sides so
        (``FP8_K_NVFP4_V.sides == (FP8, NVFP4)``)."""
        return _SIDES[self]

    @property
    def four_bit(self) -> bool:
        """Whether V (and K but for :attr:`FP8_K_NVFP4_V`) is stored as 4-bit e2m1 codes."""
        return self.sides[1] is not KVFormat.FP8

    @property
    def fp8_keys(self) -> bool:
        """Whether K is stored in FP8 with a static scale (:attr:`FP8`, :attr:`FP8_K_NVFP4_V`)."""
        return self.sides[0] is KVFormat.FP8

    @property
    def block_size(self) -> int | None:
        """Channels of head_dim sharing one 4-bit block scale, a divisor of head_dim (the
        largest of the 4-bit sides'); None for :attr:`FP8`."""
        return max((_BLOCKS[s] for s in self.sides if s in _BLOCKS), default=None)

    @property
    def label(self) -> str:
        """The format's name in prose: ``"FP8"``, ``"NVFP4"``, ``"FP8 K + NVFP4 V"``."""
        if self.sides[0] is self.sides[1]:
            return self.value.upper()
        return f"{self.sides[0].label} K + {self.sides[1].label} V"


_SIDES = {
    KVFormat.FP8: (KVFormat.FP8, KVFormat.FP8),
    KVFormat.NVFP4: (KVFormat.NVFP4, KVFormat.NVFP4),
    KVFormat.MXFP4: (KVFormat.MXFP4, KVFormat.MXFP4),
    KVFormat.FP8_K_NVFP4_V: (KVFormat.FP8, KVFormat.NVFP4),
}
_BLOCKS = {KVFormat.NVFP4: 16, KVFormat.MXFP4: 32}
"""The 4-bit formats' blocks (:data:`kvquant.schemes.NVFP4`'s and ``MXFP4``'s ``block_size``:
tests/test_schemes.py checks that they agree)."""


class KRotation(Choice):
    """A rotation of K before its fp32 group scales or its 4-bit blocks (``kvquant.patch(model,
    k_rotation=...)``; None: K stored as the model computes it)."""

    HADAMARD = "hadamard"
    """The normalised Hadamard matrix (:func:`kvquant.kernels.hadamard`; head_dim a power of two
    >= 16): K is stored as ``fp8(k @ H / s)``, each group's scale the amax of ``k @ H`` over
    448 (``nvfp4`` / ``mxfp4``: the 4-bit blocks of ``k @ H``), and the query is rotated
    alike, so scores are unchanged but for rounding."""


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


# ---------------------------------------------------------------------- per-layer K/V formats

DEFAULT_LAYER = "default"
"""The key of a per-layer ``kv_format`` map that names the format of every layer not listed."""

KVFormatMap = dict[int | str, KVFormat]
"""A checked per-layer ``kv_format`` map: layer indices (negative ones count from the last
layer) and :data:`DEFAULT_LAYER` to :class:`KVFormat` members."""

_UNQUANTIZED = frozenset({"bf16", "bfloat16", "fp16", "float16", "fp32", "float32", "none"})
"""Words a user may write for an unquantized layer: refused with their own message."""


def _map_value(label: str, value: object, owner: str) -> KVFormat:
    """``value`` (the option ``label``'s) as a :class:`KVFormat` member."""
    fmt = parse_choice(KVFormat, value)
    if fmt is not None:
        return fmt
    word = str(value).lower() if isinstance(value, str) or value is None else None
    if word in _UNQUANTIZED:
        raise OptionError(
            f"{owner}: {label}={value!r}; kvquant's paged cache stores every layer of "
            "the model and holds no unquantized layer (its layers share one page table and one "
            f"attention kernel), so the formats are {KVFormat.values()}. Fix: give the layers "
            "that need more precision 'fp8' (e.g. {0: 'fp8', -1: 'fp8', 'default': 'nvfp4'})."
        )
    raise OptionError(
        f"{owner}: {label}={value!r}; expected one of {KVFormat.values()}. Fix: give each "
        "layer one of these words."
    )


def _map_key(key: object, owner: str) -> int | str:
    if key == DEFAULT_LAYER:
        return DEFAULT_LAYER
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)  # a saved config's JSON keys are strings
    raise OptionTypeError(
        f"{owner}: kv_format has the key {key!r}; expected a layer index (an int, negative "
        f"from the last layer: -1 is the last) or {DEFAULT_LAYER!r}. Fix: e.g. "
        "kv_format={0: 'fp8', -1: 'fp8', 'default': 'nvfp4'}."
    )


def check_kv_format(value: object, owner: str) -> KVFormat | KVFormatMap:
    """The ``kv_format`` option as a :class:`KVFormat` member or a checked per-layer map.

    A map's keys are layer indices (ints, or their decimal strings as a saved JSON config
    holds them; negative ones count from the last layer) and :data:`DEFAULT_LAYER`; its values
    are :class:`KVFormat` words. Whether the indices exist and the map covers every layer is
    checked against the model (:func:`layer_kv_formats`).

    Raises:
        OptionError: an unknown format word, an unquantized layer (``"bf16"``), an empty map.
        OptionTypeError: a value that is neither a word nor a mapping, or a key that is
            neither a layer index nor ``"default"``.
    """
    if isinstance(value, Mapping):
        if not value:
            raise OptionError(
                f"{owner}: kv_format={{}} names no layer. Fix: pass a format word such as "
                "'nvfp4', or a map such as {0: 'fp8', -1: 'fp8', 'default': 'nvfp4'}."
            )
        checked: KVFormatMap = {}
        given: dict[int | str, object] = {}
        for key, fmt in value.items():
            k = _map_key(key, owner)
            if k in checked:
                raise OptionError(
                    f"{owner}: kv_format names layer {k} twice (keys {given[k]!r} and {key!r}). "
                    "Fix: give each layer one entry."
                )
            given[k] = key
            checked[k] = _map_value(f"kv_format[{key!r}]", fmt, owner)
        return checked
    if isinstance(value, str):
        fmt = parse_choice(KVFormat, value)
        if fmt is None:
            if value.lower() in _UNQUANTIZED:
                _map_value("kv_format", value, owner)
            raise OptionError(
                f"{owner}: kv_format={value!r}; expected one of {KVFormat.values()} or a "
                "per-layer map. Fix: pass kv_format='fp8' (the default) or a 4-bit format "
                "such as 'nvfp4'."
            )
        return fmt
    raise OptionTypeError(
        f"{owner}: kv_format is a {type(value).__name__}; expected a format word "
        f"{KVFormat.values()} or a per-layer map {{layer index or 'default': word}}. Fix: e.g. "
        "kv_format={0: 'fp8', -1: 'fp8', 'default': 'nvfp4'}."
    )


def layer_kv_formats(value: object, num_layers: int, owner: str) -> tuple[KVFormat, ...]:
    """Each of ``num_layers`` layers' :class:`KVFormat` under the ``kv_format`` option ``value``.

    Raises:
        OptionError: what :func:`check_kv_format` refuses; a layer index outside the model,
            two keys for one layer (``0`` and ``-num_layers``), or a map without
            ``"default"`` that leaves layers out.
    """
    checked = check_kv_format(value, owner)
    if not isinstance(checked, dict):
        return (checked,) * num_layers
    formats: dict[int, KVFormat] = {}
    for key, fmt in checked.items():
        if key == DEFAULT_LAYER:
            continue
        index = int(key)
        layer = index + num_layers if index < 0 else index
        if not 0 <= layer < num_layers:
            raise OptionError(
                f"{owner}: kv_format names layer {index}, but the model has {num_layers} "
                f"layers (indices 0..{num_layers - 1}, or -{num_layers}..-1 from the last). Fix: "
                "drop that entry or correct its index."
            )
        if layer in formats:
            raise OptionError(
                f"{owner}: kv_format names layer {layer} twice ({layer} and {layer - num_layers} "
                f"in a model of {num_layers} layers). Fix: keep one of the two entries."
            )
        formats[layer] = fmt
    default = checked.get(DEFAULT_LAYER)
    missing = [i for i in range(num_layers) if i not in formats]
    if missing and default is None:
        raise OptionError(
            f"{owner}: kv_format gives no format for layers {_ranges(missing)} of the model's "
            f"{num_layers} and has no {DEFAULT_LAYER!r} entry. Fix: add "
            f"{DEFAULT_LAYER!r}: <format> for the layers not listed, or list them."
        )
    return tuple(formats.get(i, default) for i in range(num_layers))  # type: ignore[misc]


def kv_format_json(value: object) -> object:
    """The ``kv_format`` option as JSON holds it: a word, or a map with string keys."""
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    return str(value) if isinstance(value, Choice) else value


def describe_layer_formats(formats: tuple[KVFormat, ...] | list[KVFormat]) -> str:
    """One line for messages and reports: ``"nvfp4 (every layer)"`` or
    ``"fp8: layers 0, 3; nvfp4: layers 1-2"`` (formats in the order of their first layer)."""
    if len(set(formats)) <= 1:
        return f"{formats[0] if formats else 'none'} (every layer)"
    layers: dict[KVFormat, list[int]] = {}
    for i, fmt in enumerate(formats):
        layers.setdefault(fmt, []).append(i)
    return "; ".join(f"{fmt}: layers {_ranges(idx)}" for fmt, idx in layers.items())


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    parts: list[str] = []
    start = prev = indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)

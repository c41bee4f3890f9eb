"""4-bit KV checkpoints: each producer's global-scale convention to kvquant's canonical one.

kvquant's canonical NVFP4 global scale is an fp32 dequantization multiplier ``g = amax / (6 *
448)`` (``x = (e2m1 * block_scale) * g``, :mod:`kvquant.kernels.fp4`). Producers store other
numbers under other names; :data:`CONVENTIONS` is the one table of what a stored number means
and each producer declares its convention and tensor names in its own file
(:attr:`~kvquant.checkpoint.producers.Producer.fp4`; :data:`PRODUCERS` collects them).
:func:`normalize_fp4_global_scale` turns one layer's tensor into ``g`` or raises
:class:`~kvquant.errors.ScaleFormatError` naming the layer, tensor, what was found, what was
expected and the fix; :func:`kv_formats_by_layer` (from :mod:`kvquant.checkpoint.fp4_formats`)
reads a config's per-layer K/V format map.
The sources of every entry: docs/dev/fp4-formats.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvquant.checkpoint.fp4_formats import (
    CONVENTIONS,
    Fp4Producer,
    GlobalScaleConvention,
    kv_formats_by_layer,
    kv_formats_per_layer,
)
from kvquant.checkpoint.producers import fp4_layout, fp4_layouts
from kvquant.errors import ConventionError, ScaleFormatError
from kvquant.kernels.fp4 import E2M1_MAX, E4M3_MAX, NVFP4, Fp4Format
from kvquant.registry.policy import MAX_SCALE, MIN_SCALE
from kvquant.schemes import fp4_format
from kvquant.types import LayerGeometry, RawScale

__all__ = [
    "CONVENTIONS",
    "PRODUCERS",
    "Fp4GlobalScale",
    "Fp4Layer",
    "Fp4Producer",
    "GlobalScaleConvention",
    "format_mismatch",
    "kv_formats_by_layer",
    "kv_formats_per_layer",
    "normalize_fp4_global_scale",
    "resolve_fp4_layers",
    "resolve_fp4_raws",
]


_CANONICAL = E2M1_MAX * E4M3_MAX  # 2688

PRODUCERS: dict[str, Fp4Producer] = fp4_layouts()
"""Producers of NVFP4 KV checkpoints: convention and tensor names, by producer, collected from
what each declares in its own file (:attr:`~kvquant.checkpoint.producers.Producer.fp4`)."""


@dataclass(frozen=True)
class Fp4GlobalScale:
    """One layer's canonical NVFP4 global scale for K or V.

    Attributes:
        value: fp32 ``[]`` (per-tensor) or ``[Hkv]`` (per KV head), ``amax / (6 * 448)``.
        fmt: the block format (:data:`~kvquant.kernels.fp4.NVFP4`: blocks of 16, e4m3 scales).
        tensor: the checkpoint tensor it was read from.
        convention: the key of :data:`CONVENTIONS` it was converted from.
        notes: what the conversion did (dtype casts, the convention).
    """

    value: torch.Tensor
    fmt: Fp4Format
    tensor: str
    convention: str
    notes: tuple[str, ...]

    @property
    def implied_amax(self) -> torch.Tensor:
        """The calibrated amax the scale stands for (``g * 6 * 448``)."""
        return self.value * _CANONICAL


def _producer(producer: str, convention: str | None) -> tuple[Fp4Producer, GlobalScaleConvention]:
    layout = fp4_layout(producer)
    if layout is None:
        raise ConventionError(
            f"4-bit KV producer {producer!r} is not known; expected one of "
            f"{sorted(fp4_layouts())}. Fix: name the producer that wrote the checkpoint, or pass "
            f"convention= with one of {sorted(CONVENTIONS)} and the producer whose tensor names "
            "it uses."
        )
    name = convention if convention is not None else layout.convention
    if name not in CONVENTIONS:
        raise ConventionError(
            f"global-scale convention {name!r} is not known; expected one of "
            f"{sorted(CONVENTIONS)}. Fix: pass the number the checkpoint stores, e.g. 'amax/448'."
        )
    return layout, CONVENTIONS[name]


def _find(
    tensors: Mapping[str, object], layer: str, names: tuple[str, ...], producer: str
) -> tuple[str, object]:
    wanted = [f"{layer}.{n}" for n in names]
    found = [w for w in wanted if w in tensors]
    if len(found) == 1:
        return found[0], tensors[found[0]]
    near = sorted(n for n in tensors if n.startswith(layer + "."))
    what = "several of" if found else "none of"
    raise ScaleFormatError(
        f"{layer}: found {what} {wanted} (the layer's tensors: {near or 'none'}); expected "
        f"exactly one, the {producer} NVFP4 KV global scale. Fix: check that the checkpoint was "
        f"written by {producer} with an NVFP4 KV cache, or name its actual producer."
    )


def _read(name: str, tensor: object, num_kv_heads: int) -> tuple[torch.Tensor, tuple[str, ...]]:
    """The stored values as float64 ``[]`` or ``[Hkv]``, and a note when cast."""
    if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
        found = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ScaleFormatError(
            f"{name}: found {found}; expected a floating-point tensor (float32 as written). "
            "Fix: check that the name maps to the NVFP4 global scale, not a packed payload."
        )
    shape = tuple(tensor.shape)
    if shape not in ((), (1,), (num_kv_heads,)):
        raise ScaleFormatError(
            f"{name}: found shape {shape}; expected () or (1,) (per-tensor) or ({num_kv_heads},) "
            f"(per KV head). Fix: check num_kv_heads ({num_kv_heads}) and that the tensor is "
            "the global scale (block scales are computed when tokens are written)."
        )
    values = tensor.detach().to(device="cpu", dtype=torch.float64, copy=True)
    values = values.reshape(()) if shape == (1,) else values
    notes = () if tensor.dtype == torch.float32 else (f"{name}: {tensor.dtype} cast to float32",)
    return values, notes


def _check(name: str, stored: torch.Tensor, g: torch.Tensor, conv: GlobalScaleConvention) -> None:
    flat, canon = stored.reshape(-1), g.reshape(-1)
    ok = torch.isfinite(flat) & (flat > 0)
    ok &= torch.isfinite(canon) & (canon >= MIN_SCALE) & (canon <= MAX_SCALE)
    if not bool(ok.all()):
        i = int((~ok).nonzero()[0, 0])
        raise ScaleFormatError(
            f"{name}: element {i} is {float(flat[i])!r}, read as {conv.name} (canonical "
            f"{float(canon[i])!r}); expected a finite positive number whose canonical "
            f"amax / (6 * 448) lies in [{MIN_SCALE:.3g}, {MAX_SCALE:.3g}]. Fix: re-calibrate "
            "the layer, or pass the convention the checkpoint actually uses."
        )


def normalize_fp4_global_scale(
    producer: str,
    tensors: Mapping[str, object],
    layer: str,
    cache: str,
    *,
    num_kv_heads: int,
    convention: str | None = None,
) -> Fp4GlobalScale:
    """One layer's K or V NVFP4 global scale in kvquant's canonical meaning.

    Args:
        producer: a producer with a 4-bit layout (a key of :data:`PRODUCERS`; decided from
            the checkpoint's config).
        tensors: the checkpoint's tensors by full name (e.g. ``model.layers.3.self_attn...``).
        layer: the layer's prefix, e.g. ``"model.layers.3"``.
        cache: ``"k"`` or ``"v"``.
        num_kv_heads: the model's KV heads (a per-head scale must have as many).
        convention: a key of :data:`CONVENTIONS` overriding the producer's (for a
            checkpoint whose convention is known to differ).

    Returns:
        The canonical scale with its source and notes.

    Raises:
        ConventionError: an unknown producer or convention, or ``cache`` not ``"k"``/``"v"``.
        ScaleFormatError: the tensor is missing, ambiguous, of the wrong dtype or shape, or
            holds a value that is not finite and positive in range once converted.

    Example:
        >>> import torch
        >>> t = {"model.layers.0.self_attn.k_proj.k_scale": torch.tensor(12.0 / 2688)}
        >>> g = normalize_fp4_global_scale("modelopt", t, "model.layers.0", "k", num_kv_heads=8)
        >>> round(float(g.implied_amax), 4)
        12.0
    """
    prod, conv = _producer(producer, convention)
    if cache not in ("k", "v"):
        raise ConventionError(f"cache is {cache!r}; expected 'k' or 'v'. Fix: pass 'k' or 'v'.")
    name, tensor = _find(tensors, layer, prod.k_names if cache == "k" else prod.v_names, producer)
    stored, notes = _read(name, tensor, num_kv_heads)
    g = conv.canonical(stored)
    _check(name, stored, g, conv)
    if conv.factor != 1.0 or conv.reciprocal:
        notes += (f"{name}: stored as {conv.name}, converted to amax/(6*448)",)
    return Fp4GlobalScale(g.to(torch.float32), NVFP4, name, conv.name, notes)


@dataclass(frozen=True)
class Fp4Layer:
    """One layer's 4-bit KV formats as a checkpoint declares them, with its NVFP4 global scales.

    Attributes:
        layer: the decoder layer.
        k_format: ``"fp8"`` or ``"nvfp4"``.
        v_format: ``"fp8"`` or ``"nvfp4"``.
        k: K's canonical global scale (None for an FP8 K: the FP8 scale resolves as usual).
        v: V's canonical global scale (None for an FP8 V).
    """

    layer: int
    k_format: str
    v_format: str
    k: Fp4GlobalScale | None
    v: Fp4GlobalScale | None

    @property
    def kv_format(self) -> str:
        """The layer's ``kv_format`` word (``"nvfp4"``, ``"fp8-k-nvfp4-v"`` or ``"fp8"``)."""
        if self.k_format == self.v_format:
            return self.k_format
        return f"{self.k_format}-k-{self.v_format}-v"


def resolve_fp4_layers(
    producer: str,
    formats: tuple[tuple[str, str], ...],
    tensors: Mapping[str, object],
    prefixes: Mapping[int, str],
    num_kv_heads: Mapping[int, int],
    *,
    convention: str | None = None,
) -> dict[int, Fp4Layer]:
    """The NVFP4 global scales of every layer a checkpoint stores with a 4-bit side.

    Args:
        producer: a key of :data:`PRODUCERS`.
        formats: ``(K, V)`` format per layer (:func:`kv_formats_per_layer`).
        tensors: the checkpoint's KV-scale tensors by full name.
        prefixes: each layer's tensor-name prefix (``"model.layers.3"``).
        num_kv_heads: each layer's KV heads.
        convention: overrides the producer's (see :func:`normalize_fp4_global_scale`).

    Returns:
        ``{layer: Fp4Layer}`` for the layers with an NVFP4 side (FP8 layers are left out).

    Raises:
        ScaleFormatError: a global scale is missing, ambiguous or unusable
            (:func:`normalize_fp4_global_scale`), or a producer whose convention is not
            confirmed without ``convention``.
    """
    prod = fp4_layout(producer)
    if prod is not None and not prod.confirmed and convention is None:
        confirmed = ", ".join(p.name for p in fp4_layouts().values() if p.confirmed)
        raise ScaleFormatError(
            f"the checkpoint's NVFP4 KV global scales were written by {producer}, whose stored "
            "number was not confirmed in its code; expected a producer with a confirmed "
            f"convention ({confirmed}). "
            "Fix: pass the convention the checkpoint uses (one of "
            f"{sorted(CONVENTIONS)}) to resolve_fp4_layers(convention=...)."
        )
    out: dict[int, Fp4Layer] = {}
    for layer, (k_fmt, v_fmt) in enumerate(formats):
        # the sides whose format has a global scale (NVFP4's), parsed once
        scaled = {
            c: f is not None and f.global_scale
            for c, f in zip("kv", map(fp4_format, (k_fmt, v_fmt)), strict=True)
        }
        if not any(scaled.values()):
            continue
        prefix = prefixes.get(layer, f"model.layers.{layer}")
        sides: dict[str, Fp4GlobalScale | None] = {}
        for cache in ("k", "v"):
            if not scaled[cache]:
                sides[cache] = None
                continue
            sides[cache] = normalize_fp4_global_scale(
                producer, tensors, prefix, cache, num_kv_heads=num_kv_heads[layer],
                convention=convention,
            )  # fmt: skip
        out[layer] = Fp4Layer(layer, k_fmt, v_fmt, sides["k"], sides["v"])
    return out


def resolve_fp4_raws(
    producer: str,
    formats: tuple[tuple[str, str], ...],
    raws: Sequence[RawScale],
    geometry: LayerGeometry,
) -> dict[int, Fp4Layer]:
    """:func:`resolve_fp4_layers` over discovered raw scales, for the model's first layers.

    Args:
        producer: the checkpoint's producer (discovery's ``producer``).
        formats: the checkpoint's ``(K, V)`` format per layer (its ``kv_formats``).
        raws: the raw scales (a model with fewer layers than the checkpoint: its first ones).
        geometry: the model's geometry (its layer count and KV heads per layer).

    Raises:
        ScaleFormatError: see :func:`resolve_fp4_layers`.
    """
    tensors = {r.name: r.tensor for r in raws}
    prefixes = {r.layer: r.name.split(".self_attn.")[0] for r in raws if ".self_attn." in r.name}
    heads = {i: geometry.kv_heads_of(i) for i in range(geometry.num_layers)}
    return resolve_fp4_layers(
        producer, tuple(formats[: geometry.num_layers]), tensors, prefixes, heads
    )


def format_mismatch(asked: Sequence[str], declared: Mapping[int, Fp4Layer]) -> str | None:
    """Why a ``kv_format`` per layer cannot serve a checkpoint's 4-bit layers (None: it can).

    All ``"fp8"`` (the default) follows the checkpoint; anything else must be the checkpoint's
    own format on every layer (its global scales are for those formats only).
    """
    own = [declared[i].kv_format if i in declared else "fp8" for i in range(len(asked))]
    words = [str(f) for f in asked]
    if set(words) == {"fp8"} or words == own:
        return None
    bad = [i for i, (a, o) in enumerate(zip(words, own, strict=True)) if a != o]
    return (
        f"kv_format gives layer(s) {bad} {sorted({words[i] for i in bad})}, but the checkpoint "
        f"stores them as {sorted({own[i] for i in bad})} with its own NVFP4 global scales. "
        "Fix: leave kv_format unset (the checkpoint's formats, layer by layer)."
    )
